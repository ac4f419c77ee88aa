"""An organization's usage, read for the API one query at a time per process.

Today's part of a report is summed from raw records: on a busy day, seconds of a thread. Usage is read on a thread
of its own, one query at a time, so that it never takes the threads that serve requests' database work (eight
queries at once on the shared threads held another organization's chat completion for 40 s); past a few waiting,
the next is refused with a 429 rather than queued without end.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import date
from typing import Any, Final

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from inference.openai.errors import RATE_LIMIT, APIError

from . import reports
from .reports import GroupBy, Tally, UsageGroup

MOST_QUEUED: Final = 4
RETRY_AFTER_SECONDS: Final = 2


class _Reader:
    def __init__(self) -> None:
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="usage-reader")
        self.queued = 0  # read and changed on event loops only

    async def organization_usage(
        self, *, organization_id: int, start: date, end: date, group_by: GroupBy
    ) -> tuple[list[UsageGroup], Tally]:
        if self.queued >= MOST_QUEUED:
            raise APIError(
                f"Too many usage queries are being read on this server; try again in {RETRY_AFTER_SECONDS} seconds.",
                code="rate_limited",
                status=429,
                type=RATE_LIMIT,
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        self.queued += 1
        try:
            read = sync_to_async(_read, thread_sensitive=False, executor=self.thread)
            return await read(organization_id=organization_id, start=start, end=end, group_by=group_by)
        finally:
            self.queued -= 1


def _read(**query: Any) -> tuple[list[UsageGroup], Tally]:
    """A usage query on the reader's thread, whose database connection no request cycle closes: one that broke
    (the database restarted) or grew old is replaced first, as Django does per request."""
    close_old_connections()
    try:
        return reports.organization_usage(**query)
    finally:
        close_old_connections()


reader = _Reader()
organization_usage = reader.organization_usage
