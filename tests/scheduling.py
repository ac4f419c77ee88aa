"""How ``pytest -n N --dist loadfile`` shares the suite out: a file to a process, as xdist does, except that

- the deployment tests (``tests/deploy/``) go to one process together, since they share one topology of a dozen
  processes that takes about a minute to start: split over files, each process started its own, and one started
  it again after other files;
- the longest units start first, so that no process is left running one of them alone at the end.
"""

from __future__ import annotations

from typing import Any

import pytest

# The units that take minutes, longest first; every other file follows, most tests first, as xdist orders them.
LONGEST_FIRST = (
    "tests/inference/test_responses_clients.py",  # the Codex CLI reads a 6,300-token prompt on one core
    "tests/deploy",
)


@pytest.hookimpl(optionalhook=True)  # without xdist (-p no:xdist) there is no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/deploy/"):
                return "tests/deploy"
            return super()._split_scope(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            for scope in reversed(LONGEST_FIRST):  # xdist takes the queue's first unit
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)
