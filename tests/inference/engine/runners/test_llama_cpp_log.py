"""llama.cpp's own log is written at or above the level of its logger only (quiet unless LOG_LEVEL is DEBUG)."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator

import pytest

from inference.engine.runners import llama_cpp

# ggml.h's levels in the vendored llama.cpp.
DEBUG, INFO, WARN, ERROR, CONTINUED = 1, 2, 3, 4, 5


@pytest.fixture
def native_log() -> Iterator[logging.Logger]:
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_llama_cpps_log_lines_are_written_by_their_level_as_ggml_numbers_them(
    native_log: logging.Logger, capfd: pytest.CaptureFixture[str]
) -> None:
    # llama-cpp-python's callback numbers the levels as an older llama.cpp did: INFO passed for WARNING, and every
    # start printed the model's context, line by line.
    log = llama_cpp._log_callback()
    native_log.setLevel(logging.WARNING)

    for level, text in [(INFO, b"llama_context: n_ctx = 8192"), (CONTINUED, b" cont"), (DEBUG, b"debug line")]:
        log(level, text + b"\n", ctypes.c_void_p(0))
    log(WARN, b"a warning", ctypes.c_void_p(0))
    log(CONTINUED, b", continued\n", ctypes.c_void_p(0))
    log(ERROR, b"an error\n", ctypes.c_void_p(0))

    assert capfd.readouterr().err == "a warning, continued\nan error\n"


def test_at_debug_every_line_is_written(native_log: logging.Logger, capfd: pytest.CaptureFixture[str]) -> None:
    log = llama_cpp._log_callback()
    native_log.setLevel(logging.DEBUG)

    log(INFO, b"llama_context: n_ctx = 8192\n", ctypes.c_void_p(0))

    assert capfd.readouterr().err == "llama_context: n_ctx = 8192\n"
