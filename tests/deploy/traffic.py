"""Client traffic for the fault tests and the soak: each request's outcome, told the way a client would judge it.

A request *ends properly* when it got a whole JSON body, or a stream that ended with a terminal event (``[DONE]``, an
error event, or a Responses ``response.completed`` / ``failed`` / ``incomplete``); an error response must be
OpenAI's error object, and a 503 or 429 must say when to retry.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.deploy.topology import GATEWAY_MODEL

MODEL = "b3os/smollm2-135m-instruct"
TERMINAL_RESPONSES_EVENTS = {"response.completed", "response.failed", "response.incomplete", "error"}


@dataclass
class Outcome:
    kind: str
    status: int  # 0: no HTTP answer at all (connection refused or reset, timed out)
    started: float
    elapsed: float
    ended_properly: bool
    error_code: str = ""
    retry_after: str | None = None
    problem: str = ""  # what a client would complain about, empty when nothing
    request_id: str = ""


@dataclass
class Request:
    """One kind of request: where it goes and what it sends."""

    kind: str
    path: str
    body: dict[str, Any]

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))


def chat(*, gateway: bool = False, stream: bool = False, max_tokens: int = 8, **extra: Any) -> Request:
    body: dict[str, Any] = {
        "model": GATEWAY_MODEL if gateway else MODEL,
        "messages": [{"role": "user", "content": "Name one river in Oregon."}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }
    if gateway:
        body["route"] = "gateway"
    kind = f"chat/{'gateway' if gateway else 'node'}/{'stream' if stream else 'json'}"
    return Request(kind, "/v1/infer/chat/completions", body)


def responses(*, gateway: bool = False, stream: bool = False, max_tokens: int = 16) -> Request:
    body: dict[str, Any] = {
        "model": GATEWAY_MODEL if gateway else MODEL,
        "input": "Name one river in Oregon.",
        "max_output_tokens": max_tokens,
        "stream": stream,
    }
    if gateway:
        body["route"] = "gateway"
    kind = f"responses/{'gateway' if gateway else 'node'}/{'stream' if stream else 'json'}"
    return Request(kind, "/v1/infer/responses", body)


def _error_problem(status: int, text: str, headers: httpx.Headers) -> tuple[str, str]:
    """The error's code, and what is wrong with it as an error response ('' when nothing)."""
    try:
        error = json.loads(text)["error"]
        code = str(error["code"])
        assert set(error) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError, AssertionError):
        return "", f"{status} without OpenAI's error object: {text[:200]!r}"
    if status in (429, 503) and not headers.get("retry-after"):
        return code, f"{status} {code} without Retry-After"
    return code, ""


def _stream_end(lines: list[str]) -> tuple[bool, str]:
    """Whether a stream's data lines end with a terminal event, and the error code it ended with."""
    data = [line[6:] for line in lines if line.startswith("data: ")]
    if not data:
        return False, ""
    last = data[-1]
    if last == "[DONE]":
        return True, ""
    try:
        event = json.loads(last)
    except ValueError:
        return False, ""
    if "error" in event and isinstance(event["error"], dict):
        return True, str(event["error"].get("code") or "")
    if event.get("type") in TERMINAL_RESPONSES_EVENTS:
        error = (event.get("response") or {}).get("error") or event.get("error") or {}
        return True, str(error.get("code") or "") if isinstance(error, dict) else ""
    return False, ""


async def send(
    client: httpx.AsyncClient, base_url: str, key: str, request: Request, *, hang_up_after: int | None = None
) -> Outcome:
    """Sends ``request`` and reads the whole answer, or hangs up after ``hang_up_after`` stream lines."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}

    def outcome(
        status: int, ended: bool, code: str = "", retry: str | None = None, problem: str = "", rid: str = ""
    ) -> Outcome:
        return Outcome(request.kind, status, started, time.monotonic() - started, ended, code, retry, problem, rid)

    try:
        async with client.stream("POST", base_url + request.path, json=request.body, headers=headers) as response:
            rid = response.headers.get("x-request-id", "")
            retry = response.headers.get("retry-after")
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                code, problem = _error_problem(response.status_code, text, response.headers)
                return outcome(response.status_code, True, code, retry, problem, rid)
            if not request.streamed:
                text = (await response.aread()).decode(errors="replace")
                try:
                    json.loads(text)
                except ValueError:
                    return outcome(200, False, problem=f"200 with a body that is not JSON: {text[:200]!r}", rid=rid)
                return outcome(200, True, rid=rid)
            lines: list[str] = []
            async for line in response.aiter_lines():
                lines.append(line)
                if hang_up_after is not None and sum(x.startswith("data: ") for x in lines) >= hang_up_after:
                    return outcome(200, True, "client_hung_up", rid=rid)
            ended, code = _stream_end(lines)
            return outcome(200, ended, code, problem="" if ended else "a stream without a terminal event", rid=rid)
    except httpx.TimeoutException:
        return outcome(0, False, problem="no answer in time (hung)")
    except httpx.HTTPError as exc:
        return outcome(0, False, problem=f"{type(exc).__name__}: {exc}")


async def closed_loop(
    *,
    base_url: str,
    key: str,
    mix: list[tuple[Request, float]],
    clients: int,
    duration: float,
    timeout: float = 30.0,
    hang_up_share: float = 0.0,
    seed: int = 0,
    honour_retry_after: bool = False,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """``clients`` clients, each sending its next request as soon as the last one ended, for ``duration`` seconds;
    each request drawn from ``mix`` by weight, and a share of the streamed ones hung up after a few events. With
    ``honour_retry_after`` a client refused with ``Retry-After`` waits that long (at most 5 s), as the SDKs do."""
    rng = random.Random(seed)
    requests, weights = zip(*mix, strict=True)
    outcomes: list[Outcome] = []
    stop_at = time.monotonic() + duration
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0), limits=limits) as client:

        async def one_client() -> None:
            while time.monotonic() < stop_at:
                request = rng.choices(requests, weights)[0]
                hang_up = 3 if request.streamed and rng.random() < hang_up_share else None
                result = await send(client, base_url, key, request, hang_up_after=hang_up)
                outcomes.append(result)
                if on_outcome is not None:
                    on_outcome(result)
                if result.status == 0:
                    await asyncio.sleep(0.2)  # as a client with back-off does
                elif honour_retry_after and result.retry_after:
                    await asyncio.sleep(min(5.0, float(result.retry_after)))

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return outcomes


def summary(outcomes: list[Outcome]) -> str:
    statuses = Counter((o.status, o.error_code) for o in outcomes)
    problems = Counter(f"{o.kind}: {o.problem}" for o in outcomes if o.problem)
    return f"statuses {dict(statuses)}; problems {dict(problems)}"


@dataclass
class Phases:
    """Outcomes split by when the request ran: over before the fault, started once it was repaired, and the rest."""

    before: list[Outcome] = field(default_factory=list)
    during: list[Outcome] = field(default_factory=list)
    after: list[Outcome] = field(default_factory=list)

    @classmethod
    def split(cls, outcomes: list[Outcome], *, fault_at: float, repaired_at: float) -> Phases:
        phases = cls()
        for o in outcomes:
            if o.started + o.elapsed < fault_at:
                phases.before.append(o)
            elif o.started >= repaired_at:
                phases.after.append(o)
            else:
                phases.during.append(o)
        return phases
