"""A native runner library that crashes is a clear failure naming the runner, never a silent dead process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference.engine.preflight import check_runner
from tests.conftest import DEFAULT_MODEL, ROOT

# A stand-in for a llama.cpp built with kernels this CPU cannot run: it dies on a bad memory access.
_CRASHING_LIBRARY = """
__attribute__((constructor)) static void crash(void) { *(volatile int *)0 = 0; }
"""


@pytest.fixture
def crashing_library(tmp_path: Path) -> Path:
    source = tmp_path / "crash.c"
    source.write_text(_CRASHING_LIBRARY)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libllama.so"), str(source)], check=True)
    return tmp_path


def test_the_cpu_runner_passes_its_self_test_on_this_machine() -> None:
    assert check_runner(DEFAULT_MODEL["runner"], DEFAULT_MODEL["runner_settings"]) is None


def test_a_runner_library_that_crashes_is_named_with_what_to_do(
    crashing_library: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(crashing_library))

    problem = check_runner(DEFAULT_MODEL["runner"], DEFAULT_MODEL["runner_settings"])

    assert problem is not None
    assert "The llama_cpp runner was killed by SIGSEGV" in problem
    assert "make rebuild-runner" in problem


def test_runners_without_a_native_library_of_their_own_have_nothing_to_check() -> None:
    assert check_runner("tensorrt_llm", {"model": "/models/none"}) is None


def test_serve_refuses_to_start_when_the_runner_crashes(crashing_library: Path, tmp_path: Path) -> None:
    env = {**os.environ, "B3OS_VAR_DIR": str(tmp_path / "var"), "DATABASE_URL": "", "REDIS_URL": ""}
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)

    served = subprocess.run(
        [sys.executable, "manage.py", "serve", "--port", "1"],
        cwd=ROOT,
        env={**env, "LLAMA_CPP_LIB_PATH": str(crashing_library)},
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert served.returncode != 0
    assert "b3os/smollm2-135m-instruct: The llama_cpp runner was killed by SIGSEGV" in served.stderr
    assert "Serving on" not in served.stderr
