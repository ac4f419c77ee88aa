"""Redis clients for distributed mode, one pool per event loop (asyncio clients are bound to their loop)."""

from __future__ import annotations

import asyncio
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings

_async_clients: dict[int, Any] = {}
_sync_client: Any = None


def async_client() -> Any:
    loop_id = id(asyncio.get_running_loop())
    client = _async_clients.get(loop_id)
    if client is None:
        client = _async_clients[loop_id] = aioredis.from_url(settings.REDIS_URL)
    return client


def sync_client() -> Any:
    global _sync_client
    if _sync_client is None:
        _sync_client = redis.Redis.from_url(settings.REDIS_URL)
    return _sync_client
