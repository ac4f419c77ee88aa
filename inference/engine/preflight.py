"""A test generation in a child process, before this process relies on a native runner library.

A native library built for another CPU, or with kernels this CPU cannot run, kills the process that
calls it with a signal: no Python exception, no traceback, just a dead server or test runner. So the
server and the test suite first run one short generation in a child process, and turn a crash there
into a message that names the runner and says what to do.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

TIMEOUT_SECONDS = 300
SETTINGS_REFUSED = 3  # the test generation's exit status when the runner refuses the entry's settings

# Runners whose library is native code compiled on this machine.
_SELF_TESTS = {"llama_cpp": "inference.engine.runners.llama_cpp"}

_ADVICE = {
    "llama_cpp": (
        "Its native library (llama.cpp, built by scripts/build-cpu-runner) does not run on this CPU. "
        'Rebuild it with `make rebuild-runner`; see the README, "The CPU runner\'s build".'
    ),
}


@dataclass(frozen=True, slots=True)
class RunnerProblem:
    """What a test generation found. ``crashed``: the native library cannot run on this CPU (killed by a
    signal, or hung), and nothing on it can be served; otherwise the entry's settings are wrong (a model file
    that is not there), and only that entry cannot."""

    message: str
    crashed: bool


def check_runner(runner: str, settings: dict[str, Any]) -> RunnerProblem | None:
    """``None`` when a test generation on ``runner`` works here, else what went wrong and what to do."""
    module = _SELF_TESTS.get(runner)
    if module is None:
        return None
    # The runner refusing the entry (its model file, a setting) exits with SETTINGS_REFUSED; anything else that
    # fails (the library cannot load: a missing libgomp, another glibc) is the library's.
    code = (
        f"import json, sys\nfrom inference.engine.runners.base import RunnerError\nfrom {module} import self_test\n"
        f"try:\n    self_test(json.loads(sys.argv[1]))\nexcept RunnerError as exc:\n"
        f"    print(exc, file=sys.stderr)\n    sys.exit({SETTINGS_REFUSED})"
    )
    try:
        child = subprocess.run(
            [sys.executable, "-c", code, json.dumps(settings)], capture_output=True, text=True, timeout=TIMEOUT_SECONDS
        )
    except subprocess.TimeoutExpired:
        return RunnerProblem(f"The {runner} runner did not finish a test generation in {TIMEOUT_SECONDS} s.", True)
    if child.returncode == 0:
        return None
    if child.returncode < 0:
        killed = signal.Signals(-child.returncode).name
        return RunnerProblem(
            f"The {runner} runner was killed by {killed} in a test generation. {_ADVICE[runner]}", True
        )
    last = (child.stderr.strip().splitlines() or ["no output"])[-1]
    if child.returncode == SETTINGS_REFUSED:  # the library runs; the entry is wrong
        return RunnerProblem(
            f"The {runner} runner refused the entry in a test generation ({last}): check its runner settings.", False
        )
    return RunnerProblem(f"The {runner} runner failed in a test generation ({last}). {_ADVICE[runner]}", True)
