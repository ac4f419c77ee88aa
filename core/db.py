"""Database work from async code: on the shared thread pool, each thread keeping a checked connection.

``sync_to_async``'s default (thread-sensitive) mode gives each request a thread of its own, which
costs more than the query. The shared pool's threads live on, so they close stale or broken
connections themselves before each use, as Django does at the start of a request.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from functools import wraps
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections

P = ParamSpec("P")
T = TypeVar("T")


def db_task(fn: Callable[P, T]) -> Callable[P, Coroutine[Any, Any, T]]:
    """``fn`` as a coroutine that runs on the shared pool with a fresh-enough connection."""

    def checked(*args: P.args, **kwargs: P.kwargs) -> T:
        close_old_connections()
        return fn(*args, **kwargs)

    return wraps(fn)(sync_to_async(checked, thread_sensitive=False))
