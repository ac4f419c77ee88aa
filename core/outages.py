"""Outages of the services the node depends on, told apart from bugs.

Redis (limits, key revocations, the broker and the workers' events) and the database can go away for a while: a
restart, a failover, a network cut. A request that needs one of them then fails with 503 and ``Retry-After`` (the
API's error renderer asks ``unavailable_service``), and nothing else in the process needs restarting: the clients
here reconnect on their next use.
"""

from __future__ import annotations

from typing import Literal

import redis.exceptions
from django import db
from kombu.exceptions import OperationalError as BrokerError
from redis._parsers.base import BaseParser

Service = Literal["redis", "database"]


class Misconfigured(redis.exceptions.ResponseError):
    """Redis refuses writes because it could not save its data to disk (``MISCONF``): an outage until it can."""


# redis-py names a reply's error class by its first word, and leaves this one a plain ResponseError. Both parsers
# (Python's and hiredis') and both clients (sync and asyncio) read this one table.
BaseParser.EXCEPTION_CLASSES.setdefault("MISCONF", Misconfigured)

# Reaching Redis failed (refused, reset, timed out, no pooled connection free in time), directly or as Celery's broker;
# or Redis refuses writes for a state it is in: out of memory under ``noeviction``, a replica after a failover, its
# master down, or its disk refusing a save.
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.MasterDownError,
    Misconfigured,
    BrokerError,
)
# Django wraps the driver's errors: these two are the connection's, not a query's (a bad query is a ProgrammingError,
# a constraint an IntegrityError, a value a DataError: bugs, which stay 500s).
DATABASE_ERRORS: tuple[type[BaseException], ...] = (db.OperationalError, db.InterfaceError)


def unavailable_service(exc: BaseException) -> Service | None:
    """The service whose outage ``exc`` is, or None when it is no outage."""
    if isinstance(exc, REDIS_ERRORS):
        return "redis"
    if isinstance(exc, DATABASE_ERRORS):
        return "database"
    return None
