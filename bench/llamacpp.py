"""llama.cpp built from the sources vendored in the llama-cpp-python sdist the project pins, for benchmarks.

The same engine as the CPU runner's, built with given instruction-set flags: its shared libraries (which
llama-cpp-python loads instead of its own with ``LLAMA_CPP_LIB_PATH``), ``llama-server`` and
``llama-batched-bench``. Builds are kept under ``var/bench/`` by flags, so a second run reuses them.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "var" / "bench"

# A build for the compiling CPU, otherwise alike the runner's: only the instruction sets differ.
NATIVE = ("-DGGML_NATIVE=ON", "-DGGML_LLAMAFILE=OFF")


def runner_flags() -> tuple[str, ...]:
    """The CPU runner's flags on this CPU, as scripts/build-cpu-runner chooses them."""
    script = ROOT / "scripts" / "build-cpu-runner"
    return tuple(subprocess.run([str(script), "--flags"], check=True, capture_output=True, text=True).stdout.split())


def pinned_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"llama-cpp-python==([^"]+)"', text)
    if match is None:
        raise SystemExit("pyproject.toml pins no llama-cpp-python version")
    return match.group(1)


def sources() -> Path:
    """The llama.cpp tree of the pinned llama-cpp-python sdist, downloaded and unpacked once."""
    version = pinned_version()
    tree = WORK / f"llama_cpp_python-{version}"
    if not (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        WORK.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-binary",
                ":all:",
                "--no-deps",
                f"llama-cpp-python=={version}",
                "-d",
                str(WORK),
            ],
            check=True,
        )
        with tarfile.open(WORK / f"llama_cpp_python-{version}.tar.gz") as archive:
            archive.extractall(WORK, filter="data")
    return tree / "vendor" / "llama.cpp"


def build(flags: tuple[str, ...], targets: tuple[str, ...]) -> Path:
    """Builds ``targets`` with ``flags``; returns the folder holding the programs and shared libraries."""
    source = sources()
    tag = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:10]
    folder = WORK / f"build-{tag}"
    binaries = folder / "bin"
    if all((binaries / target).exists() or (binaries / f"lib{target}.so").exists() for target in targets):
        return binaries
    print(f"building llama.cpp {' '.join(targets)} with {' '.join(flags)} (a few minutes)", file=sys.stderr, flush=True)
    subprocess.run(
        [
            "cmake",
            "-S",
            str(source),
            "-B",
            str(folder),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            *flags,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        ["cmake", "--build", str(folder), "--parallel", str(os.cpu_count() or 1), "--target", *targets],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return binaries
