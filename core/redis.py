"""Redis clients for distributed mode, one pool per event loop (asyncio clients are bound to their loop).

Every client fails fast when Redis is away: a refused or timed-out connection raises at once, after one immediate
retry that replaces a pooled connection a Redis restart left dead, instead of redis-py's default of three retries
with seconds of back-off, so a request answers 503 in milliseconds (``core.outages``). A node that refuses writes
as a replica (``READONLY``, ``MASTERDOWN``: a failover that moved the master behind the same name) is such a dead
connection too: it is dropped and the command tried once on a new one, which finds the name's new master. A pool
holds at most ``REDIS_MAX_CONNECTIONS`` connections; a command waits for a free one rather than failing when a burst
of requests finds them all busy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

# Seconds to connect, and to wait for an answer (the admission script and the key version answer in microseconds).
CONNECT_TIMEOUT = 2.0
SOCKET_TIMEOUT = 5.0

# What drops the connection and tries the command once more on a new one.
RETRIED = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.MasterDownError,
)

_async_clients: dict[int, Any] = {}
_sync_client: Any = None


def _options(retry: Any) -> dict[str, Any]:
    return {
        "retry": retry,
        "max_connections": settings.REDIS_MAX_CONNECTIONS,
        "timeout": SOCKET_TIMEOUT,  # waiting for a free pooled connection
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "socket_timeout": SOCKET_TIMEOUT,
    }


class _Redis(aioredis.Redis):  # redis-py's asyncio client is untyped here
    """A command that never swallows its task's cancellation. With a socket timeout, redis-py sends a command through
    ``asyncio.wait_for``, which on Python 3.11 returns the inner result when the task is cancelled in the step the
    send completes: a request whose client hung up just then (a job being queued, a limit being charged) went on as
    if nothing had been asked. Such a cancellation is raised once the command has answered."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        task = asyncio.current_task()
        asked = task.cancelling() if task is not None else 0
        result = await super().execute_command(*args, **options)
        if task is not None and task.cancelling() > asked:
            raise asyncio.CancelledError
        return result


def async_client() -> Any:
    loop_id = id(asyncio.get_running_loop())
    client = _async_clients.get(loop_id)
    if client is None:
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.REDIS_URL, **_options(AsyncRetry(NoBackoff(), 1, supported_errors=RETRIED))
        )
        client = _async_clients[loop_id] = _Redis(connection_pool=pool)
    return client


def sync_client() -> Any:
    global _sync_client
    if _sync_client is None:
        pool = redis.BlockingConnectionPool.from_url(
            settings.REDIS_URL, **_options(Retry(NoBackoff(), 1, supported_errors=RETRIED))
        )
        _sync_client = redis.Redis(connection_pool=pool)
    return _sync_client
