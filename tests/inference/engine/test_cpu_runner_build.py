"""scripts/build-cpu-runner builds the CPU runner's engine for the highest of three x86-64 baselines the CPU under it
runs, never AVX-512 or AMX: a wheel built for AVX2 kills the process on a CPU without it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "build-cpu-runner"

# As the runner was always built on AVX2 CPUs: the wheels already cached under that name stay the ones used.
AVX2 = "-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
NO_AVX = "-DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF"

# /proc/cpuinfo's flags lines, shortened to what tells the CPUs apart.
ZEN_4 = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx f16c fma bmi1 avx2 bmi2 avx512f avx512bw avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = f"{ZEN_4} amx_bf16 amx_tile amx_int8 avx_vnni"
SANDY_BRIDGE = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx"  # AVX, none of AVX2, FMA, F16C
HASWELL_WITHOUT_BMI2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx f16c fma avx2"  # as some hypervisors show it
NEHALEM = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt"
QEMU64 = "fpu sse sse2 pni cx16 lahf_lm"  # QEMU's default CPU model


def flags_for(tmp_path: Path, cpu: str) -> str:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {cpu}\n\nprocessor\t: 1\nflags\t\t: {cpu}\n")
    run = subprocess.run(
        [str(SCRIPT), "--flags"], env={"PATH": "/usr/bin:/bin", "B3OS_CPUINFO": str(cpuinfo)}, capture_output=True
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.decode().strip()


@pytest.mark.parametrize(
    ("cpu", "instruction_sets"),
    [
        (ZEN_4, AVX2),
        (SAPPHIRE_RAPIDS, AVX2),
        (HASWELL_WITHOUT_BMI2, f"-DGGML_SSE42=ON {NO_AVX}"),
        (SANDY_BRIDGE, f"-DGGML_SSE42=ON {NO_AVX}"),
        (NEHALEM, f"-DGGML_SSE42=ON {NO_AVX}"),
        (QEMU64, f"-DGGML_SSE42=OFF {NO_AVX}"),
    ],
)
def test_the_engine_is_built_for_the_highest_baseline_the_cpu_runs(
    tmp_path: Path, cpu: str, instruction_sets: str
) -> None:
    flags = flags_for(tmp_path, cpu)

    assert flags == f"-DGGML_NATIVE=OFF {instruction_sets} -DGGML_LLAMAFILE=OFF"
    assert "AVX512" not in flags and "AMX" not in flags
