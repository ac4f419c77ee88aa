"""A model worker whose settings are wrong exits at once and says why, instead of taking jobs it can only fail; so does
Celery beat, instead of scheduling the housekeeping where no worker runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"REDIS_URL": ""}, "REDIS_URL is not set"),
        ({"CPU_RUNNER_THREADS": "abc"}, "config.E002: CPU_RUNNER_THREADS='abc' is not an integer"),
        ({"SECRET_KEY": "change-me-to-one-long-random-string"}, "config.E013: SECRET_KEY is deploy/env.example's"),
    ],
    ids=["without-redis", "threads-not-a-number", "the-example-secret"],
)
@pytest.mark.parametrize(
    ("program", "arguments"),
    [
        ("The worker", ["worker", "-Q", "model.any", "--pool", "threads"]),
        ("Celery beat", ["beat"]),
    ],
    ids=["worker", "beat"],
)
def test_a_worker_or_beat_with_wrong_settings_exits_saying_why(
    tmp_path: Path, env: dict[str, str], said: str, program: str, arguments: list[str]
) -> None:
    # It kept running: on a broker in its own memory, or failing every job with a 500 while /health said ok.
    base = {
        **os.environ,
        "B3OS_VAR_DIR": str(tmp_path),
        "DATABASE_URL": "",
        "REDIS_URL": "redis://127.0.0.1:1/0",  # refused before it connects to anything
        "SECRET_KEY": "worker-start-tests",
    }

    schedule = ["--schedule", str(tmp_path / "celerybeat-schedule")] if program == "Celery beat" else []

    started = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "config", *arguments, *schedule],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert started.returncode == 1
    assert f"{program} cannot start:" in started.stderr
    assert said in started.stderr
