"""A loaded model's memory in the kernel's transparent huge pages (2 MB), on Linux.

Each decode step reads every weight of the model, and each sequence's part of the KV cache. In the default
4 KB pages the weights alone are tens of thousands of pages a step (about 24,000 for SmolLM2-135M), and the
CPU walks page tables for each one it has no translation cached for; in 2 MB pages, a few dozen. llama.cpp
reads the weights into a buffer it gets from ``posix_memalign``, as it gets its KV cache and compute
buffers, and glibc serves a block that large with an anonymous ``mmap`` of its own. Most kernels ship with
THP in ``madvise`` mode, where only memory marked ``MADV_HUGEPAGE`` gets huge pages.

``huge_pages()`` wraps the code that makes such buffers: the anonymous memory the process maps meanwhile is
marked ``MADV_HUGEPAGE`` and, unless told otherwise, collapsed into huge pages at once (``MADV_COLLAPSE``,
Linux 6.1 and later; on older kernels ``khugepaged`` collapses it in the background). Memory another thread
maps in the same moment is marked too, which costs nothing but its rounding to 2 MB. Where the kernel has THP
off, or the process runs elsewhere than Linux, nothing changes.

The weights are collapsed at once (some 30 ms for SmolLM2's 94 MB). The context's buffers are marked, then
collapsed by ``collapse_in_background``: llama.cpp has written all of its KV cache (720 MB for the defaults on two
cores) with zeros by then, in 4 KB pages, and collapsing it took 0.3-1.7 s of each load for steps 1-8% faster in
paired runs, where ``khugepaged`` alone takes some seven minutes to reach all of it (16 MB every 10 s). A thread of
the lowest priority does it instead, one huge page at a time, on CPU nothing else wants.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25

Range = tuple[int, int]


def anonymous_ranges(maps: str) -> list[Range]:
    """The anonymous private mappings in a ``/proc/<pid>/maps`` text (no file, not the heap or a stack)."""
    ranges = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) != 5 or fields[4] != "0" or fields[1] != "rw-p":
            continue
        start, end = fields[0].split("-")
        ranges.append((int(start, 16), int(end, 16)))
    return ranges


def new_huge_spans(before: list[Range], after: list[Range]) -> list[Range]:
    """The whole 2 MB spans of ``after`` that no range of ``before`` touches: memory mapped in between.

    A mapping made next to an older one joins it in the kernel's list, so what is new is counted by
    address, not by mapping."""
    spans = []
    for start, end in after:
        cut = [(s, e) for s, e in before if s < end and e > start]
        cursor = start
        for s, e in sorted(cut) + [(end, end)]:
            low, high = -(-cursor // HUGE_PAGE) * HUGE_PAGE, min(s, end) // HUGE_PAGE * HUGE_PAGE
            if high > low:
                spans.append((low, high))
            cursor = max(cursor, e)
    return spans


def _maps() -> str:
    return Path("/proc/self/maps").read_text()


def _madvise() -> Callable[[int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return lambda start, length, advice: int(libc.madvise(ctypes.c_void_p(start), length, advice))


def _collapse(madvise: Callable[[int, int, int], int], start: int, end: int, stopped: Callable[[], bool]) -> int:
    """Collapses ``start``-``end`` one huge page at a time (a range stops at its first failure); the bytes collapsed."""
    collapsed = 0
    for page in range(start, end, HUGE_PAGE):
        if stopped():
            break
        if madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
            collapsed += HUGE_PAGE
    return collapsed


@contextlib.contextmanager
def huge_pages(*, collapse: bool = True) -> Iterator[list[Range]]:
    """``collapse``: into huge pages now, the load waiting for the copy (about a second for 720 MB); otherwise
    marked only (for ``collapse_in_background``, or ``khugepaged`` as it scans). Yields a list that holds the spans
    marked once the block is done."""
    marked: list[Range] = []
    try:
        before = anonymous_ranges(_maps()) if sys.platform.startswith("linux") else None
    except OSError:  # no /proc (a sandbox): the memory keeps its pages
        before = None
    yield marked
    if before is None:
        return
    spans = new_huge_spans(before, anonymous_ranges(_maps()))
    madvise = _madvise()
    collapsed = 0
    for start, end in spans:
        if madvise(start, end - start, MADV_HUGEPAGE) != 0:
            log.info("no huge pages: madvise(MADV_HUGEPAGE) failed with %s", errno.errorcode.get(ctypes.get_errno()))
            return  # a kernel built without THP
        marked.append((start, end))
        if collapse:
            collapsed += _collapse(madvise, start, end, lambda: False)
    size = sum(end - start for start, end in spans)
    log.info("%d MB marked for huge pages, %d MB of it collapsed into them at once", size >> 20, collapsed >> 20)


def collapse_in_background(spans: list[Range], stopped: Callable[[], bool]) -> threading.Thread | None:
    """Collapses ``spans`` into huge pages from a thread at the lowest priority (nice 19), which runs while the
    process's other threads leave a core idle; until ``stopped()`` (the memory freed). None when there is nothing
    to collapse."""
    if not spans:
        return None

    def run() -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux
        started = time.monotonic()
        madvise = _madvise()
        collapsed = sum(_collapse(madvise, start, end, stopped) for start, end in spans)
        log.info(
            "%d MB collapsed into huge pages in the background in %.1f s", collapsed >> 20, time.monotonic() - started
        )

    thread = threading.Thread(target=run, name="huge-page-collapse", daemon=True)
    thread.start()
    return thread
