"""The gateway route: requests with ``"route": "gateway"`` go to an upstream OpenAI-compatible server.

Which models an organization reaches this way is the operator's choice: each is an enabled catalog entry, and
what the node refuses (``n`` other than 1, ``store``, ``background``, tools run on the upstream's side) is refused
here too unless the entry allows it. The body is forwarded as the client sent it (less ``route``, with the
upstream's model id), streams pass through event by event, and upstream failures become the API's own errors.

A streamed chat always asks the upstream for its usage (``stream_options.include_usage``), so that the request is
metered; the usage chunk is passed on only to a client that asked for it. The tokens-per-minute charge made at
admission, an estimate, is corrected to the upstream's count when it comes. An answer that comes without a count
(a stream cut by its client, its time limit or the upstream, or usage that is not counts) is recorded with estimates:
the body's bytes over four for its input, four characters a token of the generated text that went by for its
output (no more than the request's limit). Counts the request could not have used are not believed either. An
answer, streamed or whole, ends after ``GATEWAY_STREAM_MAX_SECONDS`` however the upstream paces it, and a stream
once it sends what no answer holds (data that is not an object, an endless event, text far past the limit).

One pooled aiohttp session per process (per event loop) keeps connections to the upstream warm; aiohttp's client
costs a fraction of httpx's per request, which is most of what this hop adds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
import orjson
from django.conf import settings
from multidict import CIMultiDictProxy

from core.upstreams import upstream_url_problem
from inference.engine.catalog import find_enabled_model
from inference.engine.generation import Failed
from inference.models import MODEL_ID_RULE, CatalogEntry, is_model_id
from inference.openai import responses as wire_responses
from inference.openai.chat import GatewayChatRequest
from inference.openai.errors import (
    ERROR_TYPES,
    INVALID_REQUEST,
    RATE_LIMIT,
    SERVER,
    APIError,
    invalid_request,
    model_missing,
    stream_options_without_stream,
    unsupported_parameter,
)
from inference.openai.responses import GatewayResponseRequest
from inference.openai.shared import invalid_type, parse

from . import revocation
from .caller import Caller, Result, admit_request, meter_for, record_error
from .metered import CLIENT_DISCONNECTED, Metered, StreamOutcome

logger = logging.getLogger("inference.serving.gateway")

ROUTE = "gateway"
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

CONNECT_TIMEOUT = 5.0
# The longest event a stream may hold (a Response's last event repeats its whole output, images included): past it
# the stream ends, since no event is that long and the upstream's framing is broken.
MAX_EVENT_BYTES = 16 << 20
# How far past the most the request allows (its output limit, times its choices) the text of a stream may run, as
# reckoned at four characters a token, before the stream is ended: the reckoning is rough, the limit is not.
OUTPUT_RECKONING_SLACK = 4
OUTPUT_RECKONING_EXTRA = 64
# What a stream's last event holds, by API.
CHAT_END = (b"[DONE]",)
RESPONSE_END = (b"response.completed", b"response.failed", b"response.incomplete")
RESPONSE_END_TYPES = frozenset(marker.decode() for marker in RESPONSE_END)
# The Responses events read whole: the endings, and the first, whose Response a failure the gateway ends it with needs.
RESPONSE_MARKERS = (*RESPONSE_END, b"response.created")
REDACTED = b"[upstream key]"
_SEQUENCE = re.compile(rb'"sequence_number"\s*:\s*(\d{1,18})')


_sessions: dict[int, aiohttp.ClientSession] = {}
UpstreamFailure = (aiohttp.ClientError, asyncio.TimeoutError)


def session() -> aiohttp.ClientSession:
    loop_id = id(asyncio.get_running_loop())
    found = _sessions.get(loop_id)
    if found is None or found.closed:
        found = _sessions[loop_id] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=settings.GATEWAY_MAX_CONNECTIONS, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=CONNECT_TIMEOUT, sock_read=settings.GATEWAY_TIMEOUT_SECONDS
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            # Bodies are relayed as they come, never decoded: the upstream is asked for them uncompressed.
            headers={"Accept-Encoding": "identity"},
        )
    return found


async def close_session() -> None:
    """Closes this event loop's connections to upstreams (the server shutting down, its requests done)."""
    if (found := _sessions.pop(id(asyncio.get_running_loop()), None)) is not None:
        await found.close()


@dataclass(frozen=True, slots=True)
class Upstream:
    base_url: str
    api_key: str
    model: str
    entry: CatalogEntry | None

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + "/" + path

    def headers(self, request_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def upstream_for(entry: CatalogEntry) -> Upstream:
    model = entry.upstream_model or entry.public_id
    if entry.upstream_base_url:
        if problem := upstream_url_problem(entry.upstream_base_url):  # saved before the catalog checked it
            logger.error("the catalog's upstream of %s cannot be used: its base URL %s", entry.public_id, problem)
            raise APIError(
                f"The gateway model {entry.public_id!r} is misconfigured on this node: tell its operator.",
                code="gateway_not_configured",
                status=503,
                type="server_error",
            )
        return Upstream(entry.upstream_base_url, entry.upstream_api_key, model, entry)
    if not settings.GATEWAY_BASE_URL:
        raise APIError(
            'No gateway is configured on this node, so "route": "gateway" cannot be served.',
            code="gateway_not_configured",
            status=503,
            param="route",
            type="server_error",
        )
    return Upstream(settings.GATEWAY_BASE_URL, settings.GATEWAY_API_KEY, model, entry)


def gateway_model(body: dict[str, Any]) -> str:
    if "model" not in body:
        raise invalid_request("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
    model = body["model"]
    if not isinstance(model, str):
        raise invalid_type("model", "a string", model)
    if not is_model_id(model):
        raise invalid_request(f"Invalid value for 'model': {MODEL_ID_RULE}.", param="model", code="invalid_value")
    return model


def not_offered(model: str) -> APIError:
    return model_missing(f"The model {model!r} is not offered through the gateway on this node.")


def refuse_unallowed(body: dict[str, Any], entry: CatalogEntry) -> None:
    """What the node refuses is refused on the way to the upstream too, unless the entry allows it (its
    ``gateway_parameters``). Responses stored upstream are never continued through it: every organization shares
    the upstream's account, so an id would reach whatever response it names there."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise unsupported_parameter(
                name, "stored responses are not continued through the gateway: send the whole conversation as input"
            )
    allowed = set(entry.gateway_parameters or ())
    if "n" not in allowed and body.get("n") not in (None, 1):
        raise unsupported_parameter("n", f"n must be 1 for {entry.public_id!r} on this node")
    if "store" not in allowed and body.get("store"):
        raise unsupported_parameter("store", f"store: true is not offered for {entry.public_id!r} on this node")
    if "background" not in allowed and body.get("background"):
        raise unsupported_parameter("background", f"background mode is not offered for {entry.public_id!r}")
    if "stored_objects" not in allowed and (where := _stored_object(body)) is not None:
        raise unsupported_parameter(
            where,
            f"what the upstream's account keeps (files, stored items, prompts) is not named by id for "
            f"{entry.public_id!r}: every organization shares that account; send the content itself",
        )
    if "hosted_tools" in allowed:
        return
    if body.get("web_search_options") is not None:
        raise unsupported_parameter("web_search_options", "tools that run on the upstream's side are not offered")
    tools = body.get("tools")
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in ("function", "custom"):
            raise unsupported_parameter(
                f"tools.{index}.type", f"{kind} tools are not offered for {entry.public_id!r} on this node"
            )


def _stored_object(body: dict[str, Any]) -> str | None:
    """Where the body names something the upstream's account keeps: a stored prompt, a stored item
    (``item_reference``), or a file by ``file_id`` anywhere in the conversation; None when it names nothing."""
    if body.get("prompt") is not None:
        return "prompt"
    for field in ("messages", "input"):
        items = body.get(field)
        for index, item in enumerate(items if isinstance(items, list) else ()):
            if isinstance(item, dict) and (
                item.get("type") == "item_reference" or ("id" in item and "type" not in item and "role" not in item)
            ):
                return f"{field}.{index}"
            if (where := _file_id_in(item, f"{field}.{index}")) is not None:
                return where
    return None


def _file_id_in(value: Any, where: str) -> str | None:
    """The path of the first ``file_id`` in ``value`` (walked without recursion), or None."""
    stack = [(where, value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            if node.get("file_id") is not None:
                return f"{path}.file_id"
            stack.extend((f"{path}.{key}", child) for key, child in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((f"{path}.{index}", child) for index, child in reversed(list(enumerate(node))))
    return None


MOST_CHOICES = 128


def estimate_input_tokens(body: dict[str, Any]) -> int:
    """What the upstream reads, without its tokenizer: about four bytes a token of the whole body (its instructions
    and tools are read too)."""
    return len(orjson.dumps(body)) // 4


def output_cap(read: GatewayChatRequest | GatewayResponseRequest) -> int:
    """What admission charges for the answer: the body's cap, or the gateway's default."""
    return read.output_cap or settings.GATEWAY_DEFAULT_MAX_TOKENS


def output_bound(body: dict[str, Any], read: GatewayChatRequest | GatewayResponseRequest, entry: CatalogEntry) -> int:
    """The most the answer can hold: the body's cap (or, without one, the model's context) for each of its choices
    (chat's ``n``, where the entry lets it through)."""
    n = body.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MOST_CHOICES else 1
    return choices * (read.output_cap or entry.context_length)


# A piece of generated text in a streamed event, and the string that holds it: chat's content, refusal, tool call
# arguments or reasoning; a Responses delta event's delta. A key spelled inside a string is escaped (\"content\") and
# never matches.
_TEXT_PIECE: Final = re.compile(
    rb'"(content|refusal|arguments|reasoning_content|reasoning|delta)"\s*:\s*"((?:[^"\\]|\\.)+)"'
)
_DELTA_EVENT: Final = re.compile(rb'"type"\s*:\s*"response\.[a-z_.]+\.delta"')
# Generated text in a whole answer's choices or output.
_ANSWER_TEXT_KEYS: Final = frozenset({"content", "refusal", "text", "arguments", "reasoning_content", "reasoning"})


def _text_tokens(size: int) -> int:
    """Tokens reckoned for a piece of text of ``size`` characters: four a token, at least one."""
    return max(1, -(-size // 4))


def _streamed_tokens(payload: bytes, *, responses: bool) -> int:
    """Tokens reckoned for the generated text an event carries: none in a Responses event that is no delta (those
    repeat the text the deltas brought, or the request's own fields)."""
    if responses and not _DELTA_EVENT.search(payload):
        return 0
    pieces = _TEXT_PIECE.findall(payload)
    keys = {key for key, _ in pieces}
    # Some servers send a model's reasoning twice in one delta, under both names.
    skip = b"reasoning" if b"reasoning_content" in keys else None
    return sum(_text_tokens(len(text)) for key, text in pieces if key != skip)


def _answer_text_size(value: Any) -> int:
    """Characters of generated text in a whole answer's ``choices`` or ``output``, walked without recursion (the
    upstream's JSON may nest as deep as the parser allows)."""
    size, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            keys = _ANSWER_TEXT_KEYS - {"reasoning"} if "reasoning_content" in node else _ANSWER_TEXT_KEYS
            for key, item in node.items():
                if key in keys and isinstance(item, str):
                    size += len(item)
                else:
                    stack.append(item)
    return size


MAX_REPORTED_TOKENS = 10**9
_WRITABLE_DEPTH: Final = 255  # the deepest nesting orjson writes


def _count(value: Any) -> int | None:
    """A token count the upstream reported (absent is 0), or None for anything that is not one."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REPORTED_TOKENS:
        return None
    return value


def redacted(text: bytes, secret: str) -> bytes:
    """``text`` for the log, without the upstream's key: some upstreams echo the credentials they refuse."""
    return text.replace(secret.encode(), REDACTED) if secret else text


@dataclass
class UpstreamUsage:
    """What the upstream reported using, and how its answer went; filled in as the response passes through."""

    started: float
    # The most the request could use: counts past them are not believed, and the text reckoned past the output's is
    # not billed.
    input_bound: int = MAX_REPORTED_TOKENS
    output_bound: int = MAX_REPORTED_TOKENS
    # For an answer that comes without the upstream's count: what the body is reckoned to hold, whether the upstream
    # answered at all (then it read the body), and tokens reckoned from the text that went by.
    input_estimate: int = 0
    answered: bool = False
    output_seen: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    status: int = 200
    error_code: str = ""
    first_byte_at: float | None = None
    secret: str = ""  # the upstream's key, kept out of the log

    @property
    def reported(self) -> bool:
        return self.input_tokens > 0 or self.output_tokens > 0

    def read_usage(self, usage: Any) -> None:
        """The upstream's usage object, if its counts are counts the request could have used: anything else (a
        string, a negative number, more than the request's context or output limit allow, cached or reasoning
        tokens beyond the count they are part of) is not trusted, and the request keeps its estimate."""
        if not isinstance(usage, dict):
            return
        details = usage.get("completion_tokens_details") or usage.get("output_tokens_details")
        prompt_details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        counts = [
            _count(usage.get("prompt_tokens", usage.get("input_tokens"))),
            _count(usage.get("completion_tokens", usage.get("output_tokens"))),
            _count(details.get("reasoning_tokens") if isinstance(details, dict) else None),
            _count(prompt_details.get("cached_tokens") if isinstance(prompt_details, dict) else None),
        ]
        if any(count is None for count in counts):
            logger.warning("the upstream reported usage that is not token counts: %s", self._for_log(usage))
            return
        read, written, reasoning, cached = (count or 0 for count in counts)
        if read > self.input_bound or written > self.output_bound or reasoning > written or cached > read:
            logger.warning(
                "the upstream reported usage the request could not have used (at most %d tokens in, %d out): %s",
                self.input_bound,
                self.output_bound,
                self._for_log(usage),
            )
            return
        self.input_tokens, self.output_tokens = read, written
        self.reasoning_tokens, self.cached_tokens = reasoning, cached

    def _for_log(self, value: Any) -> str:
        """``value`` as the log may hold it: without the key, then shortened (shortened first, a key cut in two
        would pass)."""
        try:
            written = orjson.dumps(value)
        except orjson.JSONEncodeError:  # nested deeper than orjson writes
            return f"<{type(value).__name__} nested too deep to write>"
        return redacted(written, self.secret)[:200].decode(errors="replace")

    def counted(self) -> int:
        """The tokens-per-minute charge once the upstream has reported: its counts, an estimate for one it left out."""
        outcome = self.outcome()
        return outcome.input_tokens + outcome.output_tokens

    def outcome(self, *, ran_to_end: bool = True) -> StreamOutcome:
        """The request's usage record: what the upstream reported or, for a count it did not give (the client gone,
        the stream cut, usage that is not counts), the estimate of what it read once it answered and of what had
        gone by."""
        ttft = None if self.first_byte_at is None else int((self.first_byte_at - self.started) * 1000)
        return StreamOutcome(
            status=self.status if ran_to_end else CLIENT_DISCONNECTED,
            error_code=self.error_code if ran_to_end else "client_disconnected",
            input_tokens=self.input_tokens or (self.input_estimate if self.answered else 0),
            output_tokens=self.output_tokens or min(self.output_seen, self.output_bound),
            reasoning_tokens=self.reasoning_tokens,
            cached_tokens=self.cached_tokens,
            time_to_first_token_ms=ttft,
        )


def upstream_error(
    status: int, headers: CIMultiDictProxy[str], body: bytes, *, request_id: str, secret: str = ""
) -> APIError:
    """An upstream's error, in the API's shape: its status, and its code, parameter and type when they are plain
    names. Its message may name the upstream's accounts, hosts or models: it is logged under the request id,
    and the client is told what failed and the id to quote. The upstream's own auth failures are the node's
    problem, not the client's."""
    logger.warning("the gateway answered %d to request %s: %r", status, request_id, redacted(body, secret)[:2000])
    quote = f"Quote the request id {request_id} when you report it."
    # The upstream's word on when to come back, whatever its body; a 429 always says when.
    retry = (
        {"Retry-After": retry_after(headers.get("retry-after"))} if status == 429 or "retry-after" in headers else None
    )
    if status in (401, 403):
        return APIError(
            f"The gateway refused the node's credentials. {quote}", code="upstream_error", status=502, type=SERVER
        )
    try:
        detail = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        detail = None
    if not isinstance(detail, dict) or not isinstance(detail.get("message"), str):
        return _bodiless_error(status, quote, retry)
    code, param, kind = (_plain_name(detail.get(field), secret) for field in ("code", "param", "type"))
    refused = 400 <= status < 500
    if status == 429:
        kind = RATE_LIMIT
    elif kind not in ERROR_TYPES or not refused:  # a failure passed on as a 502 is the gateway's, a server error
        kind = INVALID_REQUEST if refused else SERVER
    return APIError(
        f"The gateway {'refused the request' if refused else 'failed'} with status {status}"
        + (f" ({code})" if code else "")
        + f". {quote}",
        code=code or ("rate_limited" if status == 429 else "upstream_error"),
        status=status if refused else 502,
        param=param,
        type=kind,
        headers=retry,
    )


MOST_RETRY_AFTER = 86_400


def retry_after(value: str | None) -> str:
    """The upstream's ``Retry-After`` as whole seconds from now (it may be an HTTP date), at most a day; 1 when it
    says nothing a client could read."""
    value = (value or "").strip()
    if value.isascii() and value.isdigit():
        return str(min(int(value[:6]), MOST_RETRY_AFTER))
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return "1"
    if when.tzinfo is None:
        return "1"
    return str(min(max(math.ceil((when - datetime.now(UTC)).total_seconds()), 1), MOST_RETRY_AFTER))


def _bodiless_error(status: int, quote: str, retry: dict[str, str] | None) -> APIError:
    """An upstream's failure without an OpenAI error body: an HTML page or plain text, most often from a proxy or
    load balancer in front of it. Such a 4xx is no verdict on the request the client could act on (a wrong path,
    a proxy's own refusal), so it is the gateway's failure, a 502; except a 429, a rate limit whoever sets it,
    and a 413, the body too large for the way to the upstream, which the client can shorten."""
    message = f"The gateway answered {status} without an OpenAI error body. {quote}"
    if status == 429:
        return APIError(message, code="rate_limited", status=429, type=RATE_LIMIT, headers=retry)
    if status == 413:
        return APIError(message, code="request_too_large", status=413, type=INVALID_REQUEST, headers=retry)
    if status == 408:
        return APIError(message, code="upstream_timeout", status=504, type=SERVER, headers=retry)
    return APIError(message, code="upstream_error", status=502, type=SERVER, headers=retry)


def _plain_name(value: Any, secret: str) -> str | None:
    """``value`` if it is a short identifier (``upstream_refused``, ``messages.0.content``) that does not hold the
    upstream's key (an upstream that echoes what it was sent), else None."""
    if isinstance(value, str) and PLAIN_NAME.fullmatch(value) and not (secret and secret in value):
        return value
    return None


class NeverReached(APIError):
    """No connection to the upstream could be made: it never saw the request, which consumed nothing."""


def unreachable(exc: BaseException, *, upstream: Upstream | None = None, request_id: str = "") -> APIError:
    """The upstream did not answer: the cause is logged under the request id (with the upstream's host, which the
    client is not told), and the client gets the id to quote."""
    if upstream is not None:
        host = urlsplit(upstream.base_url).hostname
        # The exception's type and words, never its repr: aiohttp's names the request's headers, the key among them.
        cause = redacted(f"{type(exc).__name__}: {exc}".encode(), upstream.api_key).decode(errors="replace")
        logger.warning("the gateway could not reach %s for request %s: %s", host, request_id, cause)
    quote = f" Quote the request id {request_id} when you report it." if request_id else ""
    if isinstance(exc, asyncio.TimeoutError):
        return APIError(
            f"The gateway did not answer in time.{quote}", code="upstream_timeout", status=504, type="server_error"
        )
    kind = NeverReached if isinstance(exc, aiohttp.ClientConnectorError) else APIError
    return kind(
        f"The gateway could not be reached.{quote}", code="upstream_unavailable", status=502, type="server_error"
    )


async def read_bounded(response: aiohttp.ClientResponse) -> bytes:
    """The upstream's whole answer, or a 502 once it passes ``GATEWAY_MAX_RESPONSE_BYTES``."""
    most = settings.GATEWAY_MAX_RESPONSE_BYTES
    parts: list[bytes] = []
    size = 0
    chunks = response.content.iter_any()
    while True:
        # The read timeout of its own, besides the session's: a body whose framing breaks after its headers (a bad
        # chunk size) leaves aiohttp's read waiting with no error and no read timeout.
        try:
            async with asyncio.timeout(settings.GATEWAY_TIMEOUT_SECONDS):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            break
        size += len(chunk)
        if size > most:
            raise APIError(
                f"The gateway's answer is larger than {most} bytes.", code="upstream_error", status=502, type=SERVER
            )
        parts.append(chunk)
    return b"".join(parts)


async def forward_json(
    *, upstream: Upstream, path: str, body: dict[str, Any], request_id: str, tally: UpstreamUsage
) -> dict[str, Any]:
    try:
        # A whole answer has the time a stream has: an upstream that sends a byte now and then never meets the read
        # timeout.
        async with (
            asyncio.timeout(settings.GATEWAY_STREAM_MAX_SECONDS),
            session().post(
                upstream.url(path), data=orjson.dumps(body), headers=upstream.headers(request_id), allow_redirects=False
            ) as response,
        ):
            content = await read_bounded(response)
            status, headers = response.status, response.headers
    except UpstreamFailure as exc:
        raise unreachable(exc, upstream=upstream, request_id=request_id) from None
    if status >= 300:
        raise upstream_error(status, headers, content, request_id=request_id, secret=upstream.api_key)
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        raise APIError(
            f"The gateway answered with a body that is not JSON. Quote the request id {request_id} when you report it.",
            code="upstream_error",
            status=502,
            type="server_error",
        ) from None
    if not isinstance(data, dict):
        raise APIError(
            "The gateway answered with a body that is not an object. Quote the request id "
            f"{request_id} when you report it.",
            code="upstream_error",
            status=502,
            type="server_error",
        )
    # orjson reads JSON nested up to 1,024 levels but writes only 255: an answer nested deeper could not be passed on
    # (more brackets than that in all is the cheap sign to look).
    if content.count(b"[") + content.count(b"{") > _WRITABLE_DEPTH:
        try:
            orjson.dumps(data)
        except orjson.JSONEncodeError:
            raise APIError(
                f"The gateway answered with a body nested more than {_WRITABLE_DEPTH} levels deep.",
                code="upstream_error",
                status=502,
                type="server_error",
            ) from None
    a_response = data.get("object") == "response"
    if data.get("error") is not None and not data.get("choices") and not data.get("output") and not a_response:
        # Some upstreams report a failure with status 200 (an error of any shape, beside no answer): it is a failure
        # all the same, and its words are theirs. A failed Response is an answer, its error put in the API's words.
        raise upstream_error(status, headers, content, request_id=request_id, secret=upstream.api_key)
    if not isinstance(data.get(answer := "choices" if path == "chat/completions" else "output"), list):
        logger.warning(
            "the gateway answered request %s without %s: %r",
            request_id,
            answer,
            redacted(content, upstream.api_key)[:2000],
        )
        raise APIError(
            f"The gateway answered without {answer}. Quote the request id {request_id} when you report it.",
            code="upstream_error",
            status=502,
            type="server_error",
        )
    if a_response:
        _hide_response_failure(data, tally, request_id=request_id, secret=upstream.api_key)
    tally.answered = True
    tally.read_usage(data.get("usage"))
    if size := _answer_text_size([data.get("choices"), data.get("output")]):
        tally.output_seen = _text_tokens(size)
    return data


def _hide_response_failure(response: dict[str, Any], tally: UpstreamUsage, *, request_id: str, secret: str) -> None:
    """A Response's ``error`` and ``incomplete_details`` in the API's words, as a stream's ``response.failed`` has
    them: the upstream's message may name its accounts or hosts, and is logged under the request id instead."""
    if (error := response.get("error")) is not None:
        code = _failure_code(error, secret)
        logger.warning("the gateway failed request %s: %.2000r", request_id, redacted(orjson.dumps(error), secret))
        tally.status, tally.error_code = 502, code
        message = f"The gateway failed ({code}). Quote the request id {request_id} when you report it."
        response["error"] = {"code": code, "message": message}
    if "incomplete_details" in response:
        response["incomplete_details"] = incomplete_details(response["incomplete_details"])


def _failure_code(error: Any, secret: str) -> str:
    """A failed Response's error code when it is a plain name, else ``upstream_error``."""
    return (_plain_name(error.get("code"), secret) if isinstance(error, dict) else None) or "upstream_error"


def incomplete_details(details: Any) -> dict[str, str] | None:
    """Only why a Response stopped, and only a reason OpenAI's API names: the rest would be the upstream's words."""
    reason = details.get("reason") if isinstance(details, dict) else None
    return {"reason": reason} if reason in INCOMPLETE_REASONS else None


INCOMPLETE_REASONS = ("max_output_tokens", "content_filter")


async def open_stream(
    *, upstream: Upstream, path: str, body: dict[str, Any], request_id: str
) -> aiohttp.ClientResponse:
    """Send the request and wait for the upstream's status line, so failures become a proper HTTP error."""
    try:
        response = await session().post(
            upstream.url(path), data=orjson.dumps(body), headers=upstream.headers(request_id), allow_redirects=False
        )
    except UpstreamFailure as exc:
        raise unreachable(exc, upstream=upstream, request_id=request_id) from None
    if response.status >= 300:  # an error, or a redirect: the request is not sent on to another address
        content = await _drain(response)
        raise upstream_error(response.status, response.headers, content, request_id=request_id, secret=upstream.api_key)
    if response.content_type != "text/event-stream":
        content = await _drain(response)
        raise not_a_stream(response, content, request_id=request_id, secret=upstream.api_key)
    if (encoding := response.headers.get("Content-Encoding", "identity").strip().lower()) not in ("", "identity"):
        response.close()
        raise APIError(
            f"The gateway answered in the {encoding[:40]!r} encoding it was not asked for. Quote the request id "
            f"{request_id} when you report it.",
            code="upstream_error",
            status=502,
            type=SERVER,
        )
    return response


async def _drain(response: aiohttp.ClientResponse) -> bytes:
    """The rest of an answer that will not be relayed (what of it arrives), with its connection released."""
    try:
        return await read_bounded(response)
    except UpstreamFailure:
        return b""
    finally:
        response.release()


def not_a_stream(response: aiohttp.ClientResponse, body: bytes, *, request_id: str, secret: str) -> APIError:
    """A whole answer to a streamed request. An error reported with status 200 is that error; anything else is
    the gateway's failure, since no client that asked for a stream can read it."""
    try:
        detail = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        detail = None
    if isinstance(detail, dict):
        return upstream_error(response.status, response.headers, body, request_id=request_id, secret=secret)
    kind = response.content_type
    logger.warning(
        "the gateway answered request %s with %s, not a stream: %r", request_id, kind, redacted(body, secret)[:2000]
    )
    return APIError(
        f"The gateway answered a streamed request with {kind}, not an event stream. Quote the request id "
        f"{request_id} when you report it.",
        code="upstream_error",
        status=502,
        type=SERVER,
    )


@dataclass
class StreamRelay:
    """Passes an upstream's event stream on, event by event: reads usage from the event that carries it, keeps
    that event from a client that did not ask for usage, puts the upstream's own error events in the API's
    words (their message, which may name its hosts or accounts, goes to the log), ends the stream at its time
    limit, and tells the client when the upstream stopped before its stream's last event."""

    tally: UpstreamUsage
    hide_usage: bool
    deadline: float
    settle: Callable[[int], Awaitable[None]]
    request_id: str
    # What the stream's last event holds: chat's ``[DONE]``, or a Response's terminal event types.
    terminal: tuple[bytes, ...]
    secret: str = ""  # the upstream's key, kept out of the log
    api_key_id: int | None = None  # the key it answers, while ``revocation`` watches it
    _ended: bool = False
    _sequence: int = -1  # a Responses stream's last sequence number
    _response: dict[str, Any] | None = None  # the Response a Responses stream began with
    _closed: bool = False  # the stream's last event went out (chat's [DONE], a Response's terminal event)
    _failure: str = ""  # what the client was told when the upstream failed mid-stream
    _interrupted: Failed | None = None  # why the stream is to end now (its key revoked)
    _wait: asyncio.Timeout | None = None  # the wait for the upstream's next bytes, while it lasts
    _fault: str = ""  # what the upstream sent that no answer holds, which ends the stream

    def interrupt(self, failure: Failed) -> None:
        """Ends the stream with ``failure``: at once if it waits for the upstream, else once its next bytes are out."""
        self._interrupted = failure
        if self._wait is not None:
            self._wait.reschedule(asyncio.get_running_loop().time())

    def _interruption(self) -> bytes:
        assert self._interrupted is not None
        self.tally.error_code = self._interrupted.code
        message = f"{self._interrupted.message[:1].upper()}{self._interrupted.message[1:]}."
        return self._sse_error(APIError(message, code=self._interrupted.code, status=401, type=INVALID_REQUEST))

    def _sse_error(self, error: APIError) -> bytes:
        """The stream's closing error: chat's ``{"error": …}``; a Responses ``error`` event that takes the next
        sequence number, then ``response.failed``."""
        if self.terminal is not RESPONSE_END:
            return _sse_error(error)
        self._sequence += 1
        return _responses_error(error, self._sequence) + self._response_failed(error.message, error.code)

    def _response_failed(self, message: str, error_code: str | None = None) -> bytes:
        """``response.failed`` for a Responses stream the gateway ends, as the node ends its own: the Response the
        upstream began, failed (nothing when it began none, or its own ending went out)."""
        if self._response is None or self._closed:
            return b""
        self._closed = True
        self._sequence += 1
        error = {"code": wire_responses.failed_response_code(error_code), "message": message}
        event = {
            **wire_responses.lifecycle_event("failed", {**self._response, "status": "failed", "error": error}),
            "sequence_number": self._sequence,
        }
        return b"event: response.failed\ndata: " + orjson.dumps(event) + b"\n\n"

    def _time_limit(self) -> bytes:
        self.tally.error_code = "stream_time_limit"
        limit = settings.GATEWAY_STREAM_MAX_SECONDS
        return self._sse_error(
            APIError(f"The stream reached its time limit of {limit} s.", code="stream_time_limit", type="server_error")
        )

    async def relay(self, response: aiohttp.ClientResponse) -> AsyncGenerator[bytes, None]:
        frames = SSEFrames()
        finished = False
        chunks = response.content.iter_any()
        if self.api_key_id is not None:
            revocation.watch_stream(self, self.api_key_id)
        try:
            while True:
                if self._interrupted is not None:
                    yield self._interruption()
                    return
                # Each read waits no longer than the stream has left (an upstream gone silent would otherwise hold
                # the stream past its limit), nor than the read timeout: the session's own does not fire once a
                # chunked body's framing breaks after its headers, and aiohttp's read then waits with no error.
                left = self.deadline - time.monotonic()
                try:
                    async with asyncio.timeout(max(min(left, settings.GATEWAY_TIMEOUT_SECONDS), 0.0)) as self._wait:
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if self._interrupted is not None:
                        yield self._interruption()
                        return
                    if time.monotonic() < self.deadline:
                        raise  # the read timeout, not the stream's limit
                    yield self._time_limit()
                    return
                finally:
                    self._wait = None
                if self.tally.first_byte_at is None:
                    self.tally.first_byte_at = time.monotonic()
                    self.tally.answered = True
                out = []
                for event in frames.feed(chunk):
                    out.append(self._event(event))
                    if self._check_bounds(frames):
                        break
                self._check_bounds(frames)
                if out:
                    yield b"".join(out)
                if self._fault:
                    yield self._broken()
                    return
                if self._closed:
                    # The last event went out (with what came in its chunk): the answer is whole, and nothing the
                    # upstream does next (a silence, a break, the stream's limit, a key revoked) is the client's.
                    break
                if time.monotonic() > self.deadline:
                    yield self._time_limit()
                    return
            if not self._closed and (rest := frames.rest()):
                yield self._event(rest)
                if self._fault:
                    yield self._broken()
                    return
            finished = True
            if self._ended and self._failure and self.terminal is RESPONSE_END:
                yield self._response_failed(self._failure)  # the upstream's error event was its last
            elif not self._ended and not self.tally.error_code:
                yield self._upstream_error("The gateway's stream stopped before its end.")
        except UpstreamFailure as exc:
            # What breaks after the stream's last event went out (the chunked body's end never sent) takes nothing
            # from the answer, and the client, which has read its end, is told nothing more.
            if not self._closed and isinstance(exc, TimeoutError):
                self.tally.status, self.tally.error_code = 504, "upstream_timeout"
                yield self._sse_error(unreachable(exc, request_id=self.request_id))
            elif not self._closed:
                self.tally.status, self.tally.error_code = 502, "upstream_unavailable"
                yield self._sse_error(
                    APIError(
                        "The gateway connection broke mid-stream.", code="upstream_unavailable", status=502, type=SERVER
                    )
                )
        finally:
            revocation.unwatch_stream(self)
            if finished and response.content.at_eof():
                response.release()
            else:
                response.close()  # drop the connection: the upstream stops sending to a client that is gone
        if self.tally.reported:
            await self.settle(self.tally.counted())

    def _check_bounds(self, frames: SSEFrames) -> bool:
        """Whether the stream is broken: it sent what no answer holds, such as an event longer than any, or more
        text than the request allows (an upstream that does not keep to the output limit would otherwise be
        relayed, and billed, for as long as the stream may last)."""
        if self._fault:
            pass
        elif frames.waiting > MAX_EVENT_BYTES:
            self._fault = f"an event longer than {MAX_EVENT_BYTES} bytes"
        elif self.tally.output_seen > OUTPUT_RECKONING_SLACK * self.tally.output_bound + OUTPUT_RECKONING_EXTRA:
            self._fault = f"more text than the request's {self.tally.output_bound} output tokens"
        return bool(self._fault)

    def _broken(self) -> bytes:
        """The stream's end once the upstream sent what no answer holds (``_fault``): the client is told, the
        connection dropped."""
        logger.warning("the gateway's stream for request %s was ended: it sent %s", self.request_id, self._fault)
        return self._upstream_error(f"The gateway's stream was ended: it sent {self._fault}.")

    def _upstream_error(self, what: str) -> bytes:
        """The stream's closing ``upstream_error``: what went wrong, and the request id to quote."""
        self.tally.status, self.tally.error_code = 502, "upstream_error"
        message = f"{what} Quote the request id {self.request_id} when you report it."
        return self._sse_error(APIError(message, code="upstream_error", status=502, type=SERVER))

    def _failed(self, event: bytes, code: str) -> str:
        """The upstream failed mid-stream with ``code``: logged with its words, recorded, and the words the client
        gets instead."""
        logger.warning(
            "the gateway failed request %s mid-stream: %.2000r", self.request_id, redacted(event, self.secret)
        )
        if not self.tally.error_code:
            self.tally.status, self.tally.error_code = 502, code
        self._ended = True
        self._failure = (
            f"The gateway failed mid-stream ({code}). Quote the request id {self.request_id} when you report it."
        )
        return self._failure

    def _error(self, event: bytes, data: dict[str, Any], *, named: bool) -> bytes | None:
        """The upstream's error event rebuilt in the API's shape and words, or None when the event is not one: one
        that holds an ``error`` (an object, or anything else a server puts there), that is of type ``error``, or
        that SSE names ``error``. Rebuilt, not edited: whatever else the upstream put in it (a provider's raw
        message) stays behind."""
        if isinstance(data.get("error"), dict):
            error = data["error"]
        elif data.get("type") == "error" or named:
            error = data
        elif data.get("error") is not None:
            error = {}
        else:
            return None
        code = _plain_name(error.get("code"), self.secret) or "upstream_error"
        kind = error.get("type")
        replaced = APIError(
            self._failed(event, code),
            code=code,
            status=502,
            param=_plain_name(error.get("param"), self.secret),
            type=kind if isinstance(kind, str) and kind in ERROR_TYPES else SERVER,
        )
        if self.terminal is not RESPONSE_END:
            return _sse_error(replaced)
        number = data.get("sequence_number")
        self._sequence = number if isinstance(number, int) and not isinstance(number, bool) else self._sequence + 1
        return _responses_error(replaced, self._sequence)

    def _hide_failure(self, event: bytes, data: dict[str, Any]) -> None:
        """A ``response.failed`` event recorded as the failure it is, its error put in the API's words."""
        response = data.get("response")
        code = _failure_code(response.get("error") if isinstance(response, dict) else None, self.secret)
        message = self._failed(event, code)
        if isinstance(response, dict):
            response["error"] = {"code": code, "message": message}

    def _event(self, event: bytes) -> bytes:
        """The event as the client gets it (with its separator), or nothing."""
        others, payload = _sse_parts(event)
        if payload is None or not payload.strip() or self._closed:  # a comment, a keepalive, what follows the end
            return event + b"\n\n"
        if payload.strip() == b"[DONE]":  # chat's last event; some servers end a Responses stream with it too
            if self.terminal is CHAT_END:
                self._ended = self._closed = True
            return event + b"\n\n"
        if not _an_object(payload):  # no client could read it: the stream is broken
            self._fault = "data that is not a JSON object"
            return b""
        if self.terminal is RESPONSE_END and (number := _SEQUENCE.search(payload)) is not None:
            self._sequence = int(number[1])
        self.tally.output_seen += _streamed_tokens(payload, responses=self.terminal is RESPONSE_END)
        # Most events are deltas, passed on unread: only one that may be an ending, an error or usage is parsed, and
        # an ending is told by its type, not by its name turning up in a delta's text. One with an escape in it is
        # read too: a name may be written escaped ("\u0065rror"), which no marker would find.
        markers = (b'"error"', b'"usage"', b'"b3os"', *(RESPONSE_MARKERS if self.terminal is RESPONSE_END else ()))
        named = bool(others) and _named_error(others)
        if not named and b"\\u" not in payload and not any(marker in payload for marker in markers):
            if self.terminal is CHAT_END:  # a chunk says which way it went, as the node's do
                return b"\n".join([*others, b"data: " + _routed(payload)]) + b"\n\n"
            return event + b"\n\n"
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        if not isinstance(data, dict):
            return event + b"\n\n"
        if (replaced := self._error(event, data, named=named)) is not None:
            return replaced
        changed = False
        extra = data.get("b3os")
        routed = isinstance(extra, dict) and extra.get("route") == ROUTE
        if not routed and (self.terminal is CHAT_END or isinstance(extra, dict)):
            # An upstream of this platform's own says which way it served the request: here, the gateway's. A chat
            # chunk says so whatever the upstream put there, or left out.
            data["b3os"] = {**(extra if isinstance(extra, dict) else {}), "route": ROUTE}
            changed = True
        if self.terminal is RESPONSE_END and data.get("type") == "response.created":
            self._response = data.get("response") if isinstance(data.get("response"), dict) else None
        response = data.get("response")
        if self.terminal is RESPONSE_END and data.get("type") in RESPONSE_END_TYPES:
            self._ended = self._closed = True
            if data["type"] == "response.failed":
                self._hide_failure(event, data)
                changed = True
            if isinstance(response, dict) and response.get("incomplete_details") is not None:
                response["incomplete_details"] = incomplete_details(response["incomplete_details"])
                changed = True
        usage = data.get("usage") or (response.get("usage") if isinstance(response, dict) else None)
        if usage:
            self.tally.read_usage(usage)
        if self.hide_usage and "usage" in data:
            if usage and not data.get("choices"):
                return b""  # the chunk that only carries usage, which this client did not ask for
            del data["usage"]
            changed = True
        if not changed:
            return event + b"\n\n"
        # The data on one line, however many it came in, after the event's other fields (its name).
        try:
            rewritten = orjson.dumps(data)
        except orjson.JSONEncodeError:  # nested deeper than orjson writes: passed on as it came
            return event + b"\n\n"
        return b"\n".join([*others, b"data: " + rewritten]) + b"\n\n"


_ROUTED = b'{"b3os":{"route":"' + ROUTE.encode() + b'"}'


def _routed(payload: bytes) -> bytes:
    """A chat chunk's data with ``b3os.route`` first, written in without reading the rest (which holds no ``b3os``),
    on one line: data sent over several lines is joined by newlines, which in JSON are whitespace."""
    rest = payload.strip()[1:].lstrip().replace(b"\n", b" ")
    return _ROUTED + (rest if rest == b"}" else b"," + rest)


def _an_object(payload: bytes) -> bool:
    """Whether an event's data is framed as a JSON object (read whole only when the gateway needs what it says)."""
    body = payload.strip()
    return body[:1] == b"{" and body[-1:] == b"}"


def _named_error(lines: list[bytes]) -> bool:
    """Whether an event's other lines name it ``error``."""
    return any(line.startswith(b"event:") and line[6:].strip() == b"error" for line in lines)


class SSEFrames:
    """Cuts an event stream's bytes into events as they come: an event ends at a blank line, and a line at CRLF,
    LF or a CR alone, as SSE reads them (each read as LF). Each byte is searched once, however many chunks a long
    event comes in."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._searched = 0
        # A chunk ended with a CR, read as a line's end at once: an LF that begins the next chunk is the same end.
        self._carriage_return = False

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._carriage_return and chunk:
            chunk, self._carriage_return = chunk.removeprefix(b"\n"), False
        if not self._buffer and chunk.endswith(b"\n\n") and b"\r" not in chunk:
            return chunk[:-2].split(b"\n\n")  # most chunks: whole events, nothing held from before
        if b"\r" in chunk:
            self._carriage_return = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buffer = self._buffer
        buffer += chunk
        events: list[bytes] = []
        start = 0
        at = max(self._searched - 1, 0)
        while (end := buffer.find(b"\n\n", at)) != -1:
            events.append(bytes(buffer[start:end]))
            start = at = end + 2
        if start:
            del buffer[:start]
        self._searched = len(buffer)
        return events

    @property
    def waiting(self) -> int:
        """Bytes of an event not yet ended."""
        return len(self._buffer)

    def rest(self) -> bytes:
        """What came after the last event's end."""
        return bytes(self._buffer)


def _sse_parts(event: bytes) -> tuple[list[bytes], bytes | None]:
    """An event's lines other than its data, and its data as SSE reads it: each ``data`` line's value (less one
    leading space) joined by newlines, so that data split over several lines is read whole; None without any
    (a comment)."""
    if event.startswith(b"data:") and b"\n" not in event:  # most events: one data line and nothing else
        value = event[5:]
        return [], value[1:] if value.startswith(b" ") else value
    others: list[bytes] = []
    values: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            values.append(value[1:] if value.startswith(b" ") else value)
        elif line == b"data":
            values.append(b"")
        else:
            others.append(line)
    return others, b"\n".join(values) if values else None


def _responses_error(error: APIError, sequence: int) -> bytes:
    event = {
        **wire_responses.error_event(code=error.code, message=error.message, param=error.param),
        "sequence_number": sequence,
    }
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


def _sse_error(error: APIError) -> bytes:
    return b"data: " + orjson.dumps(error.body()) + b"\n\n"


async def forward_to_gateway(*, body: dict[str, Any], caller: Caller, path: str, endpoint: str) -> Result:
    """Send a request with ``"route": "gateway"`` upstream, under the same admission and accounting."""
    model = gateway_model(body)
    entry = await find_enabled_model(model)
    if entry is None:
        raise not_offered(model)
    # Only what the gateway acts on is checked here; the rest is the upstream's to judge.
    read: GatewayChatRequest | GatewayResponseRequest = (
        parse(GatewayChatRequest, body) if path == "chat/completions" else parse(GatewayResponseRequest, body)
    )
    if read.stream_options is not None and not read.stream:
        raise stream_options_without_stream()
    refuse_unallowed(body, entry)
    upstream = upstream_for(entry)
    forwarded = {key: value for key, value in body.items() if key != "route"}
    forwarded["model"] = upstream.model
    if path == "responses" and "store" not in (entry.gateway_parameters or ()):
        forwarded["store"] = False  # OpenAI keeps responses unless told not to
    streamed_chat = bool(read.stream) and path == "chat/completions"
    options = read.stream_options or {}
    asked_usage = options.get("include_usage") is True
    if streamed_chat:
        forwarded["stream_options"] = {**options, "include_usage": True}
    meter = meter_for(caller, model=model, endpoint=endpoint, route=ROUTE)
    # Admission's charge, corrected to the upstream's count when it comes.
    reads = estimate_input_tokens(body)
    grant = await admit_request(caller, meter, model_pk=entry.pk, tokens=reads + output_cap(read))
    # An upstream reads no more than its context (a body's inline images and files would count as text), and no
    # more tokens of text than the body has bytes.
    tally = UpstreamUsage(
        started=meter.started,
        input_bound=max(entry.context_length, 4 * reads + 3),
        output_bound=output_bound(body, read, entry),
        input_estimate=min(reads, entry.context_length),
        secret=upstream.api_key,
    )
    try:
        if not read.stream:
            data = await forward_json(
                upstream=upstream, path=path, body=forwarded, request_id=caller.request_id, tally=tally
            )
            extra = data.get("b3os")
            data["b3os"] = {**(extra if isinstance(extra, dict) else {}), "route": ROUTE}
            if tally.reported:
                await grant.settle(tally.counted())
            grant.release()
            tally.outcome().record(meter)
            return Result(headers=grant.headers, body=data, route=ROUTE)
        response = await open_stream(upstream=upstream, path=path, body=forwarded, request_id=caller.request_id)
    except BaseException as exc:
        try:
            if isinstance(exc, NeverReached):
                await grant.withdraw()  # as a node request no model took: the caller's windows are left as they were
            else:
                grant.release()
        finally:  # recorded even when the withdrawal is cancelled (a second hang-up) or fails
            record_error(meter, None, exc)
            if isinstance(exc, APIError):
                exc.headers = {**grant.headers, **exc.headers}  # as every answer to an admitted request has them
        raise
    relay = StreamRelay(
        tally=tally,
        hide_usage=streamed_chat and not asked_usage,
        deadline=meter.started + settings.GATEWAY_STREAM_MAX_SECONDS,
        settle=grant.settle,
        request_id=caller.request_id,
        terminal=CHAT_END if path == "chat/completions" else RESPONSE_END,
        secret=upstream.api_key,
        api_key_id=caller.api_key.pk,
    )
    stream = Metered(
        relay.relay(response),
        grant=grant,
        meter=meter,
        outcome=lambda ran_to_end: tally.outcome(ran_to_end=ran_to_end),
    )
    return Result(headers=grant.headers, stream=stream, route=ROUTE)
