"""One topology for the deployment tests, started from deploy/: PostgreSQL, Redis, a fake upstream for the gateway
route, and the Procfile's processes (two API processes behind HAProxy, two workers on the model's queue, beat and
the housekeeping worker). A test that takes a part away puts it back before it ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.topology import Topology, deployment
from tests.services import MissingProgram


@pytest.fixture(scope="package")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    # Beat's schedule every few seconds instead of hourly, so a test sees it run.
    overrides = {"USAGE_ROLLUP_INTERVAL_SECONDS": "5"}
    try:
        with deployment(tmp_path_factory.mktemp("topology"), overrides) as topology:
            for name in ("api1", "api2", "lb", "beat", "housekeeping"):
                topology.start(name)
            topology.start("smollm2", copy=1)
            topology.start("smollm2", copy=2)
            yield topology
    except MissingProgram as exc:
        pytest.fail(str(exc))
