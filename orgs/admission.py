"""Admission control: requests per minute, tokens per minute and requests in flight, per organization and model.

Windows slide: a request is admitted only if, counting it, no 60-second window holds more requests or
tokens than the limit. All three checks and the charge happen in one atomic step, in Redis (a Lua
script) when ``REDIS_URL`` is set, so every API process enforces the same numbers, or in this process
otherwise. In-flight slots expire unless their holder refreshes them, so a process that dies cannot
hold a slot for long.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from core.db import db_task
from core.outages import REDIS_ERRORS
from core.redis import async_client, sync_client

from .exceptions import LimitExceeded
from .models import Limit

logger = logging.getLogger("orgs.admission")

WINDOW = 60.0
SLOT_TTL = 15.0
# How often a slot Redis did not release is taken again, until it would have expired.
RELEASE_RETRY_SECONDS = 1.0
# The releases under way, and those being tried again: the event loop keeps only weak references to tasks.
_releasing: set[asyncio.Task[None]] = set()


def _keep(task: asyncio.Task[None]) -> None:
    _releasing.add(task)
    task.add_done_callback(_releasing.discard)


SLOT_REFRESH = 5.0
# Redis keeps a limit's keys this long past their last use: each entry's own score says when it counts no more.
KEY_GRACE = 5
LIMITS_CACHE_SECONDS = 2.0

# Wall-clock seconds, shared by every API process through Redis; tests move it.
clock = time.time


@dataclass(frozen=True, slots=True)
class Limits:
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    requests_in_flight: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.tokens_per_minute is None and self.requests_per_minute is None and self.requests_in_flight is None


@dataclass(frozen=True, slots=True)
class Decision:
    admitted: bool
    limit: str = ""  # which limit refused: requests_per_minute, tokens_per_minute, requests_in_flight
    retry_after: float = 0.0
    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_requests: float = 0.0
    reset_tokens: float = 0.0


@dataclass
class Grant:
    """An admitted request: its rate-limit headers, and its in-flight slot until ``release``."""

    headers: dict[str, str]
    _release: Any = None
    _withdraw: Any = None
    _charge: Any = None
    _charge_within: Any = None
    released: bool = False
    charged: int = 0  # tokens counted against tokens per minute for this request so far
    admitted_at: float = 0.0  # the admission's time on ``clock``
    _callbacks: list[Any] = field(default_factory=list)

    async def charge(self, tokens: int) -> None:
        """Counts ``tokens`` more against tokens per minute: input that only became known after admission."""
        if self._charge is not None and tokens > 0:
            await self._charge(tokens)
            self.charged += tokens

    async def charge_within(self, tokens: int) -> None:
        """Counts ``tokens`` more for new work of an admitted request (an agent's next step, which holds tool
        results), only if they fit its tokens per minute: else ``LimitExceeded``, and nothing is charged."""
        if self._charge_within is not None and tokens > 0:
            await self._charge_within(tokens, self.charged)
            self.charged += tokens

    async def settle(self, tokens: int) -> None:
        """Corrects the charge to ``tokens``, what the request is known to have used: more is charged, or the
        difference refunded, so an estimate made at admission does not stand in for the real count.

        A refund is dated at admission, so it leaves the window with the charge it corrects: dated later, it
        would outlive that charge and leave the window below what was used.

        It comes once the response is served (the upstream's count is in its last event): with Redis away, the
        window keeps admission's estimate, as it does for a slot it cannot release, rather than the served
        response failing at its end."""
        if self._charge is not None and tokens != self.charged:
            try:
                await self._charge(tokens - self.charged, at=self.admitted_at if tokens < self.charged else None)
            except REDIS_ERRORS as exc:
                logger.warning("tokens were left as admission charged them: %s: %s", type(exc).__name__, exc)
                return
            self.charged = tokens

    async def withdraw(self) -> None:
        """Releases the slot and takes the request out of the windows, its count and its charge, as though it had
        been refused: for a request no model took (a full queue, no worker), which consumed nothing. With Redis away
        the windows keep it, as they keep a slot they cannot release."""
        try:
            if self._withdraw is not None and not self.released:
                try:
                    await self._withdraw(self.charged)
                except REDIS_ERRORS as exc:
                    logger.warning("a request no model took was left in the windows: %s: %s", type(exc).__name__, exc)
                else:  # the headers tell what is left once it is out
                    for kind, back in (("requests", 1), ("tokens", self.charged)):
                        remaining, limit = f"x-ratelimit-remaining-{kind}", f"x-ratelimit-limit-{kind}"
                        if remaining in self.headers:
                            left = int(self.headers[remaining]) + back
                            self.headers[remaining] = str(min(int(self.headers[limit]), left))
        finally:  # cancelled meanwhile (a second hang-up, a shutdown), the slot is released all the same
            self.release()

    def on_release(self, callback: Any) -> None:
        self._callbacks.append(callback)

    def release(self) -> None:
        if not self.released:
            self.released = True
            if self._release is not None:
                self._release()
            for callback in self._callbacks:
                callback()


# --- limits, from the database, cached briefly so admin changes apply within seconds ----------

_limits_cache: dict[tuple[int, int | None], tuple[float, Limits]] = {}


def _load_limits(organization_id: int, model_pk: int | None) -> Limits:
    rows = {row.model_id: row for row in Limit.objects.filter(organization_id=organization_id)}
    # A per-model row replaces the organization's default for that model.
    row = rows.get(model_pk) if model_pk is not None and model_pk in rows else rows.get(None)
    if row is None:
        return Limits()
    return Limits(row.tokens_per_minute, row.requests_per_minute, row.requests_in_flight)


async def limits_for(organization_id: int, model_pk: int | None) -> Limits:
    key = (organization_id, model_pk)
    now = time.monotonic()
    cached = _limits_cache.get(key)
    if cached and now - cached[0] < LIMITS_CACHE_SECONDS:
        return cached[1]
    limits = await db_task(_load_limits)(organization_id, model_pk)
    _limits_cache[key] = (now, limits)
    if limits.unlimited and not settings.DISTRIBUTED:
        # Removed from another process (``set_limit``, a shell), where ``limits_changed`` could not reach this one's
        # counts: they are dropped as it reads the limit gone, so one set again counts from then on.
        memory_store.forget(f"{organization_id}:{model_pk or 0}")
    return limits


def clear_limits_cache() -> None:
    _limits_cache.clear()


def limits_changed(organization_id: int) -> None:
    """A limit of the organization was saved or deleted: limits are read again from the next request. A model it
    limits no more is counted no more, and its counts are dropped: a limit set on it later counts from then on, as on
    an organization that never had one, not from the counts of the minute before (held in the window until then)."""
    clear_limits_cache()
    store = _store()
    try:
        for key in store.windows_of(organization_id):
            if _load_limits(organization_id, int(key.split(":")[1]) or None).unlimited:
                store.forget(key)
    except REDIS_ERRORS as exc:  # the change is saved all the same; the counts expire within the minute
        logger.warning(
            "the counts of organization %s stay until they expire: %s: %s", organization_id, type(exc).__name__, exc
        )


# --- the in-process store --------------------------------------------------------------------


@dataclass
class _Window:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0
    slots: dict[str, float] = field(default_factory=dict)


class MemoryStore:
    def __init__(self) -> None:
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def try_admit(
        self,
        key: str,
        limits: Limits,
        tokens: int,
        slot: str,
        now: float,
        *,
        dry: bool = False,
        tokens_only: bool = False,
    ) -> Decision:
        """Admits and charges, or refuses; ``dry`` only tells whether it would admit, and charges nothing;
        ``tokens_only`` charges tokens that must fit, with no request counted and no slot held."""
        with self._lock:
            w = self._windows.setdefault(key, _Window())
            while w.requests and w.requests[0] <= now - WINDOW:
                w.requests.popleft()
            while w.tokens and w.tokens[0][0] <= now - WINDOW:
                w.token_sum -= w.tokens.popleft()[1]
            for held, expires in list(w.slots.items()):
                if expires <= now:
                    del w.slots[held]
            rpm, tpm, inflight = limits.requests_per_minute, limits.tokens_per_minute, limits.requests_in_flight
            refused: tuple[str, float] | None = None
            if rpm is not None and len(w.requests) + 1 > rpm:
                retry = (w.requests[len(w.requests) - rpm] + WINDOW - now) if rpm > 0 else WINDOW
                refused = ("requests_per_minute", retry)
            elif tpm is not None and w.token_sum + tokens > tpm:
                refused = ("tokens_per_minute", _token_retry(list(w.tokens), w.token_sum, tokens, tpm, now))
            elif inflight is not None and len(w.slots) + 1 > inflight:
                refused = ("requests_in_flight", 1.0)
            elif dry:
                return Decision(True)
            else:
                if not tokens_only:
                    w.requests.append(now)
                    w.slots[slot] = now + SLOT_TTL
                if tokens:
                    w.tokens.append((now, tokens))
                    w.token_sum += tokens
            return Decision(
                refused is None,
                *(refused or ("", 0.0)),
                remaining_requests=None if rpm is None else rpm - len(w.requests),
                remaining_tokens=None if tpm is None else tpm - w.token_sum,
                # OpenAI's "time until the rate limit resets to its initial state": until the window is empty.
                reset_requests=w.requests[-1] + WINDOW - now if w.requests else 0.0,
                reset_tokens=w.tokens[-1][0] + WINDOW - now if w.tokens else 0.0,
            )

    def charge(self, key: str, tokens: int, now: float) -> None:
        """Counts ``tokens`` (a refund: fewer) at ``now``, which may be a past moment still in the window."""
        with self._lock:
            window = self._windows.setdefault(key, _Window())
            bisect.insort(window.tokens, (now, tokens))
            window.token_sum += tokens

    def release(self, key: str, slot: str) -> None:
        with self._lock:
            window = self._windows.get(key)
            if window is not None:
                window.slots.pop(slot, None)

    def windows_of(self, organization_id: int) -> list[str]:
        """The keys of the organization's windows, one for each model it was counted on."""
        with self._lock:
            return [key for key in self._windows if key.startswith(f"{organization_id}:")]

    def forget(self, key: str) -> None:
        with self._lock:
            self._windows.pop(key, None)

    def withdraw(self, key: str, slot: str, tokens: int, at: float) -> None:
        """Takes back a request admitted at ``at``: its count, its slot and ``tokens`` of its charge."""
        with self._lock:
            window = self._windows.get(key)
            if window is None:
                return
            window.slots.pop(slot, None)
            if at in window.requests:
                window.requests.remove(at)
        if tokens:
            self.charge(key, -tokens, at)

    def refresh(self, held: dict[str, set[str]], now: float) -> None:
        with self._lock:
            for key, slots in held.items():
                window = self._windows.get(key)
                for slot in slots:
                    if window is not None and slot in window.slots:
                        window.slots[slot] = now + SLOT_TTL

    def reset(self) -> None:
        with self._lock:
            self._windows.clear()


def _token_retry(entries: list[tuple[float, int]], total: int, wanted: int, limit: int, now: float) -> float:
    """Seconds until enough charged tokens leave the window for ``wanted`` more to fit."""
    if wanted > limit:
        return WINDOW
    for at, tokens in entries:
        total -= tokens
        if total + wanted <= limit:
            return at + WINDOW - now
    return WINDOW


# --- the Redis store ---------------------------------------------------------------------------

# KEYS: requests zset, tokens zset, slots zset, tokens-in-window sum.
# ARGV: now, window, rpm, tpm, inflight, tokens, slot, slot_ttl, nonce, dry, tokens only, keys' expiry (seconds).
# Limits of -1 mean unlimited; with dry "1" it only tells whether it would admit, and charges nothing; with tokens
# only "1" it charges the tokens if they fit, and counts no request and holds no slot.
# A request is counted under its slot's id, so that one no model took can be taken back (``withdraw``).
# Token entries are members "nonce:tokens" scored by time; their running sum is kept beside them, so
# admission touches only the entries that leave the window, not all of them.
# A refund is an entry of negative tokens.
_ADMIT_LUA = """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local rpm, tpm, inflight = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local wanted, slot, ttl, nonce = tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8]), ARGV[9]
local horizon = now - window
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', horizon)
local leaving = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', horizon)
if #leaving > 0 then
  local gone = 0
  for i = 1, #leaving do gone = gone + tonumber(string.match(leaving[i], ':(%-?%d+)$')) end
  redis.call('DECRBY', KEYS[4], gone)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', horizon)
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local nreq = redis.call('ZCARD', KEYS[1])
local total = tonumber(redis.call('GET', KEYS[4]) or '0')
-- What the window holds, for the rate-limit headers of an admission or a refusal alike.
local function state(verdict, limit, retry)
  local newest_req = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  local newest_tok = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
  local reset_req, reset_tok = 0, 0
  if #newest_req > 0 then reset_req = tonumber(newest_req[2]) + window - now end
  if #newest_tok > 0 then reset_tok = tonumber(newest_tok[2]) + window - now end
  return {verdict, limit, tostring(retry), tostring(redis.call('ZCARD', KEYS[1])), tostring(total),
          tostring(reset_req), tostring(reset_tok)}
end
if rpm >= 0 and nreq + 1 > rpm then
  local retry = window
  if rpm > 0 then
    local e = redis.call('ZRANGE', KEYS[1], nreq - rpm, nreq - rpm, 'WITHSCORES')
    retry = tonumber(e[2]) + window - now
  end
  return state(0, 'requests_per_minute', retry)
end
if tpm >= 0 and total + wanted > tpm then
  local retry = window
  if wanted <= tpm then
    local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
    local left = total
    for i = 1, #entries, 2 do
      left = left - tonumber(string.match(entries[i], ':(%-?%d+)$'))
      if left + wanted <= tpm then
        retry = tonumber(entries[i + 1]) + window - now
        break
      end
    end
  end
  return state(0, 'tokens_per_minute', retry)
end
if inflight >= 0 and redis.call('ZCARD', KEYS[3]) + 1 > inflight then
  return state(0, 'requests_in_flight', 1)
end
if ARGV[10] == '1' then
  return {1, '', '0', tostring(nreq), tostring(total), '0', '0'}
end
if ARGV[11] ~= '1' then
  redis.call('ZADD', KEYS[1], now, slot)
  redis.call('ZADD', KEYS[3], now + ttl, slot)
end
if wanted > 0 then
  redis.call('ZADD', KEYS[2], now, nonce .. ':' .. wanted)
  total = redis.call('INCRBY', KEYS[4], wanted)
end
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], tonumber(ARGV[12])) end
return state(1, '', 0)
"""


# KEYS: tokens zset, tokens-in-window sum. ARGV: now, tokens, nonce, expiry seconds.
_CHARGE_LUA = """
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[3] .. ':' .. ARGV[2])
redis.call('INCRBY', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
"""


def _key_seconds() -> int:
    """How long a limit's keys outlive their last use: past the window and a slot's life, nothing in them counts."""
    return math.ceil(WINDOW + SLOT_TTL) + KEY_GRACE


_PREFIX = "b3os:lim:"


class RedisStore:
    def __init__(self) -> None:
        self._scripts: dict[int, tuple[Any, Any]] = {}

    def _client(self) -> tuple[Any, Any]:
        client = async_client()
        if id(client) not in self._scripts:
            self._scripts[id(client)] = (client.register_script(_ADMIT_LUA), client.register_script(_CHARGE_LUA))
        return client, self._scripts[id(client)][0]

    @staticmethod
    def _keys(key: str) -> list[str]:
        return [f"{_PREFIX}{key}:req", f"{_PREFIX}{key}:tok", f"{_PREFIX}{key}:slots", f"{_PREFIX}{key}:toksum"]

    # The two below are called from the thread that changed a limit (the admin's, a command's): a plain client.
    def windows_of(self, organization_id: int) -> list[str]:
        """The keys of the organization's windows, one for each model it was counted on."""
        names = sync_client().scan_iter(match=f"{_PREFIX}{organization_id}:*", count=1000)
        return sorted({name.decode().removeprefix(_PREFIX).rsplit(":", 1)[0] for name in names})

    def forget(self, key: str) -> None:
        sync_client().delete(*self._keys(key))

    async def try_admit(
        self,
        key: str,
        limits: Limits,
        tokens: int,
        slot: str,
        now: float,
        *,
        dry: bool = False,
        tokens_only: bool = False,
    ) -> Decision:
        _, script = self._client()
        unlimited = lambda v: -1 if v is None else v  # noqa: E731
        result = await script(
            keys=self._keys(key),
            args=[
                now,
                WINDOW,
                unlimited(limits.requests_per_minute),
                unlimited(limits.tokens_per_minute),
                unlimited(limits.requests_in_flight),
                tokens,
                slot,
                SLOT_TTL,
                secrets.token_hex(8),
                "1" if dry else "0",
                "1" if tokens_only else "0",
                _key_seconds(),
            ],
        )
        used_requests, used_tokens = int(result[3]), int(result[4])
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        return Decision(
            int(result[0]) == 1,
            result[1].decode(),
            float(result[2]),
            remaining_requests=None if rpm is None else rpm - used_requests,
            remaining_tokens=None if tpm is None else tpm - used_tokens,
            reset_requests=float(result[5]),
            reset_tokens=float(result[6]),
        )

    async def charge(self, key: str, tokens: int, now: float) -> None:
        client, _ = self._client()
        keys = self._keys(key)
        await self._scripts[id(client)][1](
            keys=[keys[1], keys[3]], args=[now, tokens, secrets.token_hex(8), _key_seconds()]
        )

    async def withdraw(self, key: str, slot: str, tokens: int, at: float) -> None:
        client, _ = self._client()
        keys = self._keys(key)
        async with client.pipeline(transaction=True) as pipe:
            pipe.zrem(keys[0], slot)
            pipe.zrem(keys[2], slot)
            await pipe.execute()
        if tokens:
            await self.charge(key, -tokens, at)

    async def release(self, key: str, slot: str) -> None:
        client, _ = self._client()
        try:
            await client.zrem(self._keys(key)[2], slot)
        except REDIS_ERRORS as exc:
            # Nobody refreshes the slot any more: it expires within SLOT_TTL seconds all the same. Until then it is
            # taken again each second: a Redis back sooner (restarted with its data, or paused) frees it then, and a
            # client retrying its 503 is not refused for a slot nothing holds.
            logger.warning("an in-flight slot is released once Redis answers: %s: %s", type(exc).__name__, exc)
            _keep(asyncio.get_running_loop().create_task(self._release_later(key, slot)))

    async def _release_later(self, key: str, slot: str) -> None:
        deadline = time.monotonic() + SLOT_TTL
        while time.monotonic() < deadline:
            await asyncio.sleep(RELEASE_RETRY_SECONDS)
            try:
                await self._client()[0].zrem(self._keys(key)[2], slot)
                return
            except Exception:  # noqa: BLE001  (Redis away, or a connection it left half made: tried until the deadline)
                continue

    async def refresh(self, held: dict[str, set[str]], now: float) -> None:
        client, _ = self._client()
        async with client.pipeline(transaction=False) as pipe:
            for key, slots in held.items():
                for slot in slots:
                    pipe.zadd(self._keys(key)[2], {slot: now + SLOT_TTL}, xx=True)
                # The slots' key lives on with them: expiring as set at the last admission, it would take a stream
                # that outlasts it out of the count, and admit past the limit in flight.
                pipe.expire(self._keys(key)[2], _key_seconds())
            await pipe.execute()


# --- admission -----------------------------------------------------------------------------------

memory_store = MemoryStore()
_held: dict[str, set[str]] = {}
_refresher: asyncio.Task[None] | None = None
_redis_store: RedisStore | None = None


def _store() -> MemoryStore | RedisStore:
    global _redis_store
    if not settings.DISTRIBUTED:
        return memory_store
    if _redis_store is None:
        _redis_store = RedisStore()
    return _redis_store


async def _refresh_forever() -> None:
    while True:
        await asyncio.sleep(SLOT_REFRESH)
        held = {key: set(slots) for key, slots in _held.items() if slots}
        if held:
            store = _store()
            try:
                if isinstance(store, RedisStore):
                    await store.refresh(held, clock())
                else:
                    store.refresh(held, clock())
            except Exception:  # noqa: BLE001  (a missed refresh only risks an early expiry)
                pass


def _ensure_refresher() -> None:
    global _refresher
    if _refresher is None or _refresher.done() or _refresher.get_loop() is not asyncio.get_running_loop():
        _refresher = asyncio.get_running_loop().create_task(_refresh_forever())


def _duration(seconds: float) -> str:
    """OpenAI's reset format: 1s, 6m0s, 150ms."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _headers(limits: Limits, decision: Decision) -> dict[str, str]:
    headers: dict[str, str] = {}
    if limits.requests_per_minute is not None:
        headers["x-ratelimit-limit-requests"] = str(limits.requests_per_minute)
        headers["x-ratelimit-remaining-requests"] = str(max(0, decision.remaining_requests or 0))
        headers["x-ratelimit-reset-requests"] = _duration(decision.reset_requests)
    if limits.tokens_per_minute is not None:
        headers["x-ratelimit-limit-tokens"] = str(limits.tokens_per_minute)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, decision.remaining_tokens or 0))
        headers["x-ratelimit-reset-tokens"] = _duration(decision.reset_tokens)
    return headers


_DESCRIPTIONS = {
    "requests_per_minute": "requests per minute",
    "tokens_per_minute": "tokens per minute",
    "requests_in_flight": "requests in flight",
}


async def precheck(*, organization_id: int, model_pk: int | None, tokens: int) -> None:
    """Raise ``LimitExceeded`` if a request of at least ``tokens`` would be refused now; charges nothing.

    Rendering and counting a prompt cost more than admission: a client already over its limits is refused
    before that work, on a lower bound of what the request will be charged. Passing is no promise: ``admit``
    decides, atomically, on the real count."""
    limits = await limits_for(organization_id, model_pk)
    if limits.unlimited:
        return
    key = f"{organization_id}:{model_pk or 0}"
    store = _store()
    if isinstance(store, RedisStore):
        decision = await store.try_admit(key, limits, tokens, "", clock(), dry=True)
    else:
        decision = store.try_admit(key, limits, tokens, "", clock(), dry=True)
    if not decision.admitted:
        raise _refusal(limits, decision, tokens, at_least=True)


def _refusal(
    limits: Limits, decision: Decision, tokens: int, *, at_least: bool = False, held: int | None = None
) -> LimitExceeded:
    """Why ``decision`` refused a request for ``tokens`` (``held``: a step of a request already holding that many).
    A limit no wait would ever meet is named before the one that refused it now: retrying is of no use."""
    # A step's request is retried whole: admitted again, then the same step.
    limit = next((one for one in _DESCRIPTIONS if _never_admitted(limits, one, tokens + (held or 0))), decision.limit)
    value = {
        "requests_per_minute": limits.requests_per_minute,
        "tokens_per_minute": limits.tokens_per_minute,
        "requests_in_flight": limits.requests_in_flight,
    }[limit]
    detail = f"Rate limit reached: {_DESCRIPTIONS[limit]} (limit {value})."
    never = _never_admitted(limits, limit, tokens + (held or 0))
    if limit == "tokens_per_minute":
        if held is not None:
            detail += f" The response's next step needs {tokens} more tokens for its input, beside the {held} it holds."
        else:
            needs = "at least " if at_least else ""
            detail += f" This request needs {needs}{tokens} tokens (input estimate plus maximum output)."
        if never:
            detail += " It can never fit: lower the maximum output tokens or the input."
    elif never:
        detail += " A limit of 0 admits no request: this one can never be admitted, however long it waits."
    retry = None if never else max(1, math.ceil(decision.retry_after))
    if retry is not None:
        detail += f" Try again in {retry}s."
    # The window as it stands: the limit that refused shows what is left of it, the others are untouched.
    return LimitExceeded(limit=limit, retry_after=retry, detail=detail, headers=_headers(limits, decision))


async def _take_back(
    store: RedisStore, admitting: asyncio.Future[Decision], key: str, slot: str, tokens: int, at: float
) -> None:
    """An admission whose request left before it knew the answer, taken out of the windows once Redis has given it:
    no usage record would count it."""
    try:
        if not (await admitting).admitted:
            return
        await store.withdraw(key, slot, tokens, at)
    except Exception as exc:  # noqa: BLE001  (Redis's errors, or the script's: nobody else reads them)
        logger.warning(
            "a request that left during its admission was left in the windows: %s: %s", type(exc).__name__, exc
        )
        await store.release(key, slot)  # its slot at least, which release retries while Redis is away


def _never_admitted(limits: Limits, limit: str, tokens: int) -> bool:
    """Whether ``limit`` refuses the request whatever the window holds: no wait would admit it."""
    if limit == "tokens_per_minute":
        return limits.tokens_per_minute is not None and tokens > limits.tokens_per_minute
    if limit == "requests_per_minute":
        return limits.requests_per_minute == 0
    return limits.requests_in_flight == 0


async def admit(*, organization_id: int, model_pk: int | None, tokens: int) -> Grant:
    """Admit a request charging ``tokens`` (input estimate + maximum output), or raise ``LimitExceeded``."""
    limits = await limits_for(organization_id, model_pk)
    if limits.unlimited:
        return Grant(headers={})
    key = f"{organization_id}:{model_pk or 0}"
    slot = secrets.token_hex(8)
    store = _store()
    now = clock()
    if isinstance(store, RedisStore):
        # Redis answers whatever happens to this request meanwhile: cut off mid-call, a connection of the pool would
        # be left with an answer nobody reads.
        admitting = asyncio.ensure_future(store.try_admit(key, limits, tokens, slot, now))
        try:
            decision = await asyncio.shield(admitting)
        except asyncio.CancelledError:  # the client left while Redis admitted it, or not
            _keep(asyncio.get_running_loop().create_task(_take_back(store, admitting, key, slot, tokens, now)))
            raise
    else:
        decision = store.try_admit(key, limits, tokens, slot, now)
    if not decision.admitted:
        raise _refusal(limits, decision, tokens)
    _held.setdefault(key, set()).add(slot)
    _ensure_refresher()

    def release() -> None:
        _held.get(key, set()).discard(slot)
        if isinstance(store, RedisStore):
            _keep(asyncio.get_running_loop().create_task(store.release(key, slot)))
        else:
            store.release(key, slot)

    async def withdraw(tokens: int) -> None:
        _held.get(key, set()).discard(slot)
        refund = tokens if now > clock() - WINDOW else 0  # a charge that has left the window already
        if isinstance(store, RedisStore):
            await store.withdraw(key, slot, refund, now)
        else:
            store.withdraw(key, slot, refund, now)

    async def charge(tokens: int, *, at: float | None = None) -> None:
        if at is not None and at <= clock() - WINDOW:
            return  # what it corrects has left the window already
        if isinstance(store, RedisStore):
            await store.charge(key, tokens, clock() if at is None else at)
        else:
            store.charge(key, tokens, clock() if at is None else at)

    async def charge_within(tokens: int, held: int) -> None:
        only_tokens = Limits(tokens_per_minute=limits.tokens_per_minute)
        if isinstance(store, RedisStore):
            charged = await store.try_admit(key, only_tokens, tokens, "", clock(), tokens_only=True)
        else:
            charged = store.try_admit(key, only_tokens, tokens, "", clock(), tokens_only=True)
        if not charged.admitted:
            raise _refusal(limits, charged, tokens, held=held)

    metered = limits.tokens_per_minute is not None
    return Grant(
        headers=_headers(limits, decision),
        _release=release,
        _withdraw=withdraw,
        _charge=charge if metered else None,
        _charge_within=charge_within if metered else None,
        charged=tokens,
        admitted_at=now,
    )
