"""A loaded model's weights and KV cache sit in the kernel's 2 MB pages: the memory mapped while they are made is
marked for huge pages and collapsed into them, the weights at once, the KV cache in the background."""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import sys
import time
from pathlib import Path

import pytest

from inference.engine.runners import llama_cpp
from inference.engine.runners.huge_pages import (
    HUGE_PAGE,
    anonymous_ranges,
    collapse_in_background,
    huge_pages,
    new_huge_spans,
)
from tests.conftest import DEFAULT_MODEL

MB = 1 << 20
MAPS = """\
55b992a39000-55b9953c2000 rw-p 00000000 00:00 0                          [heap]
7fc43ae00000-7fc477600000 rw-p 00000000 00:00 0
7fc46fbb3000-7fc4757cf000 r--s 001b3000 fe:00 5441465                    /models/SmolLM2.gguf
7fc477600000-7fc477601000 ---p 00000000 00:00 0
7fc477e00000-7fc47be00000 rw-p 00000000 00:00 0
7ffd1c0e5000-7ffd1c106000 rw-p 00000000 00:00 0                          [stack]
"""


def collapses_at_once() -> bool:
    """THP not switched off, and ``MADV_COLLAPSE`` (Linux 6.1)."""
    if not sys.platform.startswith("linux"):
        return False
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not enabled.exists() or "[never]" in enabled.read_text():
        return False
    major, minor = (int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    return (major, minor) >= (6, 1)


needs_collapse = pytest.mark.skipif(
    not collapses_at_once(), reason="the kernel collapses memory into huge pages only in the background"
)


def mappings() -> list[tuple[str, dict[str, str]]]:
    """Each mapping of ``/proc/self/smaps``: its line as in ``maps``, and its fields (``THPeligible``: ``1``)."""
    found: list[tuple[str, dict[str, str]]] = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            found.append((line, {}))
        elif found:
            name, _, value = line.partition(":")
            found[-1][1][name] = value.strip()
    return found


def huge_kb(address: int) -> int:
    """``AnonHugePages`` of the mapping that holds ``address``."""
    for line, fields in mappings():
        start, end = (int(part, 16) for part in line.split()[0].split("-"))
        if start <= address < end:
            return int(fields["AnonHugePages"].split()[0])
    return 0


def marked_for_huge_pages() -> list[tuple[int, int]]:
    """The anonymous mappings the kernel may give huge pages (``THPeligible``), and their sizes."""
    return [
        (start, end - start)
        for line, fields in mappings()
        if fields.get("THPeligible") == "1"
        for start, end in anonymous_ranges(line)
    ]


def huge_kb_in_all() -> int:
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"^AnonHugePages:\s+(\d+)", rollup, re.MULTILINE).group(1))  # type: ignore[union-attr]


def test_the_anonymous_private_memory_is_read_from_the_maps_and_files_the_heap_stacks_and_guards_are_not() -> None:
    assert anonymous_ranges(MAPS) == [(0x7FC43AE00000, 0x7FC477600000), (0x7FC477E00000, 0x7FC47BE00000)]


def test_memory_mapped_meanwhile_counts_by_its_whole_huge_pages() -> None:
    assert new_huge_spans([], [(3 * MB, 9 * MB)]) == [(4 * MB, 8 * MB)]
    assert new_huge_spans([(0, 1 * MB)], [(0, 1 * MB), (6 * MB, 7 * MB)]) == []


def test_memory_mapped_next_to_older_memory_counts_only_the_new_part() -> None:
    before = [(10 * MB, 12 * MB), (20 * MB, 21 * MB)]
    # The kernel joined the new memory to both older mappings: one range from 4 MB to 30 MB.
    after = [(4 * MB, 30 * MB)]

    assert new_huge_spans(before, after) == [(4 * MB, 10 * MB), (12 * MB, 20 * MB), (22 * MB, 30 * MB)]


def test_memory_already_there_is_left_alone() -> None:
    assert new_huge_spans([(0, 64 * MB)], [(0, 64 * MB)]) == []


def test_without_proc_the_block_runs_and_its_memory_keeps_its_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc() -> str:
        raise FileNotFoundError("/proc/self/maps")

    monkeypatch.setattr("inference.engine.runners.huge_pages._maps", no_proc)
    ran = []
    with huge_pages():
        ran.append(True)

    assert ran == [True]


@needs_collapse
def test_memory_mapped_and_written_inside_the_block_sits_in_huge_pages_when_it_ends() -> None:
    with huge_pages():
        memory = mmap.mmap(-1, 8 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        memory.write(b"\1" * (8 * MB))
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))

    assert huge_kb(address) >= 3 * HUGE_PAGE // 1024  # 8 MB from wherever it starts: at least three whole 2 MB pages

    del address
    memory.close()


@needs_collapse
def test_a_loaded_models_weights_sit_in_huge_pages() -> None:
    path = llama_cpp.model_path(DEFAULT_MODEL["runner_settings"])
    before = huge_kb_in_all()
    model = llama_cpp._load_model(path, vocab_only=False)
    try:
        assert (huge_kb_in_all() - before) * 1024 >= Path(path).stat().st_size * 0.8
    finally:
        model.close()


@needs_collapse
def test_memory_only_marked_in_the_block_is_collapsed_by_a_thread_in_the_background() -> None:
    with huge_pages(collapse=False) as marked:
        memory = mmap.mmap(-1, 8 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        memory.write(b"\1" * (8 * MB))
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    collapsing = collapse_in_background(marked, lambda: False)

    assert collapsing is not None
    collapsing.join(timeout=120)
    assert huge_kb(address) >= 3 * HUGE_PAGE // 1024
    assert memory[: 8 * MB] == b"\1" * (8 * MB)

    del address
    memory.close()


def test_nothing_marked_starts_no_thread() -> None:
    assert collapse_in_background([], lambda: False) is None


@needs_collapse
def test_a_runners_kv_cache_is_marked_for_huge_pages_and_collapsed_into_them_in_the_background() -> None:
    settings = {**DEFAULT_MODEL["runner_settings"], "parallel": 2, "n_ctx": 4096}
    before_marked, before_huge = set(marked_for_huge_pages()), huge_kb_in_all()
    runner = llama_cpp.LlamaCppRunner(settings)
    try:
        grown = sum(size for start, size in marked_for_huge_pages() if (start, size) not in before_marked)
        assert grown >= runner.kv_cache_bytes
        # Beside the weights, collapsed as they loaded; its thread runs on CPU nothing else wants.
        expected = 0.8 * Path(llama_cpp.model_path(settings)).stat().st_size + 0.9 * runner.kv_cache_bytes
        deadline = time.monotonic() + 120
        while (huge_kb_in_all() - before_huge) * 1024 < expected and time.monotonic() < deadline:
            time.sleep(0.1)

        assert (huge_kb_in_all() - before_huge) * 1024 >= expected
    finally:
        runner.close()
