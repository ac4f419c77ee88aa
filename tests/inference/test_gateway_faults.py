"""The gateway route against upstreams and clients that misbehave.

The upstream is a real HTTP server on loopback whose answer to each model is scripted by the test, byte for byte,
so that it can do what a faulty server does: answer HTML, cut a stream, stall, echo its credentials. The gateway
runs in this process, so its time limits are set small per test and its accounting read from the admission store.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.utils import timezone

from inference.api.middleware import RequestIdLogFilter
from inference.models import CatalogEntry, UsageRecord
from inference.serving import gateway
from inference.usage import records as usage
from orgs import admission
from orgs.admission import memory_store
from orgs.models import APIKey, Limit, Organization
from tests.conftest import API, read_stream, sse_data

UPSTREAM_KEY = "sk-upstream-faults-7f3a9c2e"
CHAT = "/v1/infer/chat/completions"
RESPONSES = "/v1/infer/responses"

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


# --- a scripted upstream ------------------------------------------------------------------------------------


@dataclass
class ScriptedUpstream:
    """An OpenAI-compatible server on loopback, in its own thread and event loop; ``scripts`` say, by model, what
    it sends back. ``hung_up`` counts the streams whose reader (the gateway) closed the connection on them."""

    url: str = ""
    scripts: dict[str, Script] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    hung_up: int = 0
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)
            }
            body = json.loads(await reader.readexactly(int(headers.get("content-length", "0"))))
            self.requests.append({"path": lines[0].split(" ")[1], "headers": headers, "body": body})
            await self.scripts[body["model"]](reader, writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def start(self) -> None:
        ready = threading.Event()

        async def serve() -> None:
            server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
            ready.set()
            async with server:
                await server.serve_forever()

        def run() -> None:
            task = self.loop.create_task(serve())
            self.loop.run_forever()
            task.cancel()
            self.loop.run_until_complete(asyncio.gather(task, return_exceptions=True))

        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)


def answer(status: int, body: bytes | Any, *, headers: dict[str, str] | None = None) -> Script:
    """A whole answer; ``body`` as bytes is sent as it is, anything else as JSON."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    kind = "text/html" if payload.lstrip().startswith(b"<") else "application/json"
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            f"HTTP/1.1 {status} Status\r\ncontent-type: {kind}\r\ncontent-length: {len(payload)}\r\n"
            f"connection: close\r\n{extra}\r\n".encode()
            + payload
        )

    return script


def events(*parts: bytes, then: str = "end", upstream: ScriptedUpstream | None = None) -> Script:
    """An event stream of ``parts`` (each sent as its own chunk), then: ``end`` (the chunked body's end), ``cut``
    (the connection closed mid-body) or ``stall`` (silence until the reader hangs up, counted in ``hung_up``)."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in parts:
            writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            await writer.drain()
        if then == "end":
            writer.write(b"0\r\n\r\n")
        elif then == "stall":
            await asyncio.wait_for(reader.read(), 60)  # until the gateway closes the connection
            if upstream is not None:
                upstream.hung_up += 1

    return script


def silence(upstream: ScriptedUpstream) -> Script:
    """Takes the request and never answers, until the reader hangs up."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.wait_for(reader.read(), 60)
        upstream.hung_up += 1

    return script


def chat_chunk(content: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
        "usage": None,
    }


def data(value: Any) -> bytes:
    return b"data: " + json.dumps(value).encode() + b"\n\n"


CHAT_USAGE = {**chat_chunk(""), "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 8}}
DONE = b"data: [DONE]\n\n"


def response_event(kind: str, number: int, **extra: Any) -> bytes:
    return f"event: {kind}\n".encode() + data({"type": kind, "sequence_number": number, **extra})


RESPONSE: dict[str, Any] = {"id": "resp_1", "object": "response", "status": "in_progress", "output": [], "usage": None}
COMPLETED = response_event(
    "response.completed",
    2,
    response={**RESPONSE, "status": "completed", "usage": {"input_tokens": 11, "output_tokens": 8}},
)


# --- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    server.start()
    yield server
    server.loop.call_soon_threadsafe(server.loop.stop)


@dataclass
class Gateway:
    api: API
    upstream: ScriptedUpstream
    organization_id: int
    entries: dict[str, CatalogEntry] = field(default_factory=dict)

    async def offer(self, model: str, script: Script) -> None:
        """``model`` offered through the gateway, answered upstream by ``script``."""
        self.upstream.scripts[model] = script
        self.entries[model] = await CatalogEntry.objects.acreate(
            public_id=model,
            runner="gateway",
            upstream_base_url=self.upstream.url,
            upstream_api_key=UPSTREAM_KEY,
        )

    async def post(self, model: str, *, path: str = CHAT, **extra: Any) -> Any:
        return await self.api.post(path, self.body(model, path=path, **extra))

    @staticmethod
    def body(model: str, *, path: str = CHAT, **extra: Any) -> dict[str, Any]:
        body = {"model": model, "route": "gateway", **extra}
        return body | ({"messages": [{"role": "user", "content": "Hi"}]} if path == CHAT else {"input": "Hi"})

    async def stream(self, model: str, *, path: str = CHAT, **extra: Any) -> tuple[Any, str]:
        response = await self.post(model, path=path, stream=True, **extra)
        assert response.status_code == 200, response.content
        return response, await read_stream(response)

    async def record(self, response: Any) -> UsageRecord:
        usage.flush()
        return await UsageRecord.objects.aget(request_id=response["x-request-id"])

    def window(self, model: str) -> tuple[int, int]:
        """Tokens charged against the minute, and slots in flight, for ``model``."""
        found = memory_store._windows[f"{self.organization_id}:{self.entries[model].pk}"]
        return found.token_sum, len(found.slots)


@pytest.fixture
async def gw(api: API, upstream: ScriptedUpstream, organization: Organization, settings: Any) -> AsyncIterator[Gateway]:
    settings.GATEWAY_TIMEOUT_SECONDS = 1
    settings.GATEWAY_STREAM_MAX_SECONDS = 30
    # The pooled session holds the read timeout it was made with.
    for pooled in list(gateway._sessions.values()):
        await pooled.close()
    gateway._sessions.clear()
    # Limits far off, so that admission keeps the accounting this file reads.
    await Limit.objects.acreate(organization=organization, tokens_per_minute=10**9, requests_in_flight=1000)
    yield Gateway(api=api, upstream=upstream, organization_id=organization.pk)
    for pooled in list(gateway._sessions.values()):
        await pooled.close()
    gateway._sessions.clear()


def error_of(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def last_event(text: str) -> dict[str, Any]:
    return json.loads(sse_data(text)[-1])


def stream_error(text: str, path: str) -> dict[str, Any]:
    """The error a stream the gateway ended closes with: chat's last chunk, or a Responses ``error`` event, which
    ``response.failed`` follows with the Response the upstream began (if it began one)."""
    if path == CHAT:
        return last_event(text)["error"]
    sent = [json.loads(line) for line in sse_data(text)]
    if not any(event["type"] == "response.created" for event in sent):  # no Response begun to fail
        assert sent[-1]["type"] == "error"
        return sent[-1]
    *_, error, failed = sent
    assert (error["type"], failed["type"], failed["response"]["status"]) == ("error", "response.failed", "failed")
    assert failed["sequence_number"] == error["sequence_number"] + 1
    return error


async def ended_whole(gw: Gateway, response: Any, text: str) -> None:
    """The stream reached the client whole, with no error after it, and is recorded as a success with its usage."""
    assert '"error"' not in text
    record = await gw.record(response)
    assert (record.status, record.error_code, record.output_tokens) == (200, "", 8)


pytestmark = pytest.mark.django_db(transaction=True)


BOTH = pytest.mark.parametrize("path", [CHAT, RESPONSES], ids=["chat", "responses"])


def chat_stream(*middle: bytes) -> tuple[bytes, ...]:
    return (data(chat_chunk("Hel")), *middle, data(chat_chunk("lo")), data(CHAT_USAGE), DONE)


def responses_stream(*middle: bytes) -> tuple[bytes, ...]:
    created = response_event("response.created", 0, response=RESPONSE)
    return (created, *middle, response_event("response.output_text.delta", 1, delta="Hi"), COMPLETED)


def first_event(path: str) -> bytes:
    return data(chat_chunk("Hel")) if path == CHAT else response_event("response.created", 0, response=RESPONSE)


# --- whole answers ------------------------------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize(
    ("status", "body", "headers"),
    [
        (500, b"<html><body>Internal Server Error</body></html>", {}),
        (502, b"<html>Bad Gateway</html>", {}),
        (503, b"<html>busy</html>", {}),
        (200, b"not json at all", {}),
        (200, b"[1, 2]", {}),
        (200, b"", {}),
        (301, b"", {"Location": "http://elsewhere.example/"}),
        (500, {"error": "a string, not an object"}, {}),
        (200, {"error": "plain string error at internal-7.example"}, {}),
    ],
    ids=[
        *("500-html", "502-html", "503-html", "not-json", "not-an-object", "empty", "redirect", "error-string"),
        "status-200-error-string",
    ],
)
async def test_a_faulty_upstreams_answer_is_a_502_in_openais_shape_and_is_accounted_once(
    gw: Gateway, path: str, status: int, body: Any, headers: dict[str, str]
) -> None:
    await gw.offer("faulty", answer(status, body, headers=headers))

    response = await gw.post("faulty", path=path)

    assert response.status_code == 502
    assert error_of(response)["type"] == "server_error"
    record = await gw.record(response)
    assert (record.status, record.error_code, record.input_tokens, record.output_tokens) == (
        502,
        "upstream_error",
        0,
        0,
    )
    assert gw.window("faulty")[1] == 0  # its slot is free


@BOTH
async def test_an_upstream_key_echoed_in_its_refusal_reaches_neither_the_client_nor_the_log(
    gw: Gateway, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    refusal = {
        "message": f"Incorrect API key: {UPSTREAM_KEY}",
        "type": "invalid_request_error",
        "code": "invalid_api_key",
    }
    await gw.offer("refusing", answer(401, {"error": refusal}))

    response = await gw.post("refusing", path=path)

    assert response.status_code == 502
    assert UPSTREAM_KEY not in response.content.decode()
    assert "Incorrect API key" in caplog.text and UPSTREAM_KEY not in caplog.text


async def test_an_upstream_key_echoed_in_an_error_event_stays_out_of_the_log(
    gw: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    failure = {"message": f"key {UPSTREAM_KEY} is over quota", "type": "server_error", "code": "quota"}
    await gw.offer("echoing", events(data(chat_chunk("Hel")), data({"error": failure})))

    _, text = await gw.stream("echoing")

    assert UPSTREAM_KEY not in text
    assert "over quota" in caplog.text and UPSTREAM_KEY not in caplog.text


@BOTH
@pytest.mark.parametrize(("given", "expected"), [({}, "1"), ({"Retry-After": "7"}, "7")], ids=["no-retry", "retry"])
async def test_an_upstream_429_without_an_openai_body_is_a_rate_limit_that_says_when_to_come_back(
    gw: Gateway, path: str, given: dict[str, str], expected: str
) -> None:
    await gw.offer("limited", answer(429, b"<html>Too Many Requests</html>", headers=given))

    response = await gw.post("limited", path=path)

    assert response.status_code == 429
    assert (error_of(response)["type"], error_of(response)["code"]) == ("rate_limit_error", "rate_limited")
    assert response["Retry-After"] == expected
    # The organization's own limits beside the upstream's word, as on every answer to an admitted request.
    assert response["x-ratelimit-limit-tokens"] == str(10**9)


@BOTH
@pytest.mark.parametrize(
    ("status", "expected", "kind"),
    [(404, 502, "server_error"), (400, 502, "server_error"), (413, 413, "invalid_request_error")],
)
async def test_an_upstream_4xx_page_without_an_openai_body_is_the_gateways_failure_unless_the_client_can_act_on_it(
    gw: Gateway, path: str, status: int, expected: int, kind: str
) -> None:
    await gw.offer("proxied", answer(status, b"<html><body><h1>nginx</h1></body></html>"))

    response = await gw.post("proxied", path=path)

    assert (response.status_code, error_of(response)["type"]) == (expected, kind)


@BOTH
async def test_an_upstream_503_passes_on_when_to_come_back(gw: Gateway, path: str) -> None:
    await gw.offer("busy", answer(503, b"<html>busy</html>", headers={"Retry-After": "5"}))

    response = await gw.post("busy", path=path)

    assert response.status_code == 502 and response["Retry-After"] == "5"


@BOTH
async def test_an_upstream_key_echoed_as_its_errors_code_or_param_is_neither_relayed_nor_recorded(
    gw: Gateway, path: str
) -> None:
    refusal = {"message": "no", "type": "invalid_request_error", "param": UPSTREAM_KEY, "code": UPSTREAM_KEY}
    await gw.offer("echoing", answer(400, {"error": refusal}))

    response = await gw.post("echoing", path=path)

    assert response.status_code == 400 and UPSTREAM_KEY not in response.content.decode()
    assert error_of(response) | {"message": ""} == {
        "message": "",
        "type": "invalid_request_error",
        "param": None,
        "code": "upstream_error",
    }
    assert (await gw.record(response)).error_code == "upstream_error"


@BOTH
async def test_an_upstream_429_is_a_rate_limit_error_whatever_type_it_gives(gw: Gateway, path: str) -> None:
    refusal = {"message": "slow down", "type": "invalid_request_error", "param": None, "code": "rate_limit_exceeded"}
    await gw.offer("limited", answer(429, {"error": refusal}))

    response = await gw.post("limited", path=path)

    assert response.status_code == 429
    assert (error_of(response)["type"], error_of(response)["code"]) == ("rate_limit_error", "rate_limit_exceeded")


@BOTH
async def test_an_openai_error_with_fields_of_its_own_reaches_the_client_in_four_fields(gw: Gateway, path: str) -> None:
    refusal = {"message": "no", "type": "invalid_request_error", "param": "messages", "code": "bad", "host": "db-7"}
    await gw.offer("chatty", answer(400, {"error": refusal}))

    response = await gw.post("chatty", path=path)

    assert response.status_code == 400
    assert error_of(response) | {"message": ""} == {
        "message": "",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "bad",
    }


@BOTH
async def test_an_upstream_that_reports_a_failure_with_status_200_fails_and_its_words_go_to_the_log(
    gw: Gateway, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    await gw.offer("sly", answer(200, {"error": {"message": "provider at db-7 is down", "code": "provider_down"}}))

    response = await gw.post("sly", path=path)

    assert response.status_code == 502
    assert error_of(response)["code"] == "provider_down" and "db-7" not in error_of(response)["message"]
    assert "db-7" in caplog.text
    record = await gw.record(response)
    assert (record.status, record.error_code) == (502, "provider_down")


async def test_a_whole_failed_response_keeps_the_upstreams_words_out_as_a_streamed_one_does(
    gw: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    failed = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": "m",
        "status": "failed",
        "output": [],
        "error": {"code": "server_error", "message": "upstream shard gw-7.corp.internal failed (acct org-SECRET)"},
        "incomplete_details": {"reason": "host internal-7.example down"},
    }
    await gw.offer("failing", answer(200, failed))

    response = await gw.post("failing", path=RESPONSES)

    body = response.json()
    assert body["error"]["code"] == "server_error" and "gw-7" not in body["error"]["message"]
    assert "Quote the request id" in body["error"]["message"]
    assert body["incomplete_details"] is None  # a reason OpenAI's API does not name would be the upstream's words
    assert "gw-7.corp.internal" in caplog.text
    record = await gw.record(response)
    assert (record.status, record.error_code) == (502, "server_error")


@BOTH
async def test_stream_options_without_stream_is_refused_in_the_nodes_words_before_anything_is_sent(
    gw: Gateway, path: str
) -> None:
    await gw.offer("options", answer(200, {"choices": []}))

    response = await gw.post("options", path=path, stream_options={"include_usage": True})

    assert response.status_code == 400
    assert error_of(response) == {
        "message": "stream_options is only allowed when stream is true.",
        "type": "invalid_request_error",
        "param": "stream_options",
        "code": "invalid_value",
    }


@BOTH
async def test_a_whole_answer_to_a_streamed_request_is_a_502_not_a_stream_of_raw_json(gw: Gateway, path: str) -> None:
    answered = {"id": "x", "object": "chat.completion", "choices": []} if path == CHAT else {**RESPONSE, "output": []}
    await gw.offer("unstreamed", answer(200, answered))

    response = await gw.post("unstreamed", path=path, stream=True)

    assert response.status_code == 502
    error = error_of(response)
    assert error["code"] == "upstream_error" and "application/json, not an event stream" in error["message"]
    record = await gw.record(response)
    assert (record.status, record.error_code) == (502, "upstream_error")
    assert gw.window("unstreamed")[1] == 0  # its slot is free


@BOTH
async def test_a_streamed_request_answered_with_an_error_and_status_200_fails_with_that_errors_code(
    gw: Gateway, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    await gw.offer("sly", answer(200, {"error": {"message": "provider at db-7 is down", "code": "provider_down"}}))

    response = await gw.post("sly", path=path, stream=True)

    assert response.status_code == 502
    assert error_of(response)["code"] == "provider_down" and "db-7" not in error_of(response)["message"]
    assert "db-7" in caplog.text


@BOTH
async def test_an_answer_without_usage_keeps_admissions_estimate_and_is_recorded_with_its_own(
    gw: Gateway, path: str
) -> None:
    text = "The Willamette flows north."  # 27 characters: 7 tokens at four a token
    if path == CHAT:
        answered = {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": text}}]}
    else:
        answered = {**RESPONSE, "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}
    await gw.offer("unmetered", answer(200, answered))

    response = await gw.post("unmetered", path=path)

    assert response.status_code == 200
    record = await gw.record(response)
    reads = gateway.estimate_input_tokens(gw.body("unmetered", path=path))
    assert (record.status, record.input_tokens, record.output_tokens) == (200, reads, 7)
    tokens, slots = gw.window("unmetered")
    assert tokens > 4096 and slots == 0  # the estimate stands: nothing said it was less


@BOTH
async def test_an_answer_nested_deeper_than_can_be_written_is_a_502_and_recorded(gw: Gateway, path: str) -> None:
    depth = 1000
    key = b'"choices"' if path == CHAT else b'"output"'
    await gw.offer("deep", answer(200, b'{"id": "x", ' + key + b": " + b"[" * depth + b"]" * depth + b"}"))

    response = await gw.post("deep", path=path)

    # It cannot be written back as JSON (orjson writes 255 levels): the gateway's fault, in the API's shape.
    assert response.status_code == 502
    assert error_of(response)["code"] == "upstream_error" and "nested" in error_of(response)["message"]
    record = await gw.record(response)
    assert (record.status, record.error_code) == (502, "upstream_error")


async def test_a_streamed_usage_event_nested_deeper_than_can_be_written_passes_as_it_came(gw: Gateway) -> None:
    deep = b"[" * 300 + b"]" * 300
    # A chunk with text and usage, which the gateway would pass on without its usage (the client did not ask for it).
    choices = b'"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": null}]'
    usage = b"data: {" + choices + b', "usage": {"prompt_tokens": 11, "completion_tokens": 8}, "x": ' + deep + b"}\n\n"
    await gw.offer("deep-usage", events(data(chat_chunk("Hi")), usage, DONE))

    response, text = await gw.stream("deep-usage")

    assert text.endswith("data: [DONE]\n\n") and '"content": "!"' in text
    record = await gw.record(response)
    assert (record.status, record.input_tokens, record.output_tokens) == (200, 11, 8)


@BOTH
async def test_a_request_the_upstream_never_answered_is_recorded_with_no_tokens(gw: Gateway, path: str) -> None:
    await gw.offer("mute", silence(gw.upstream))

    response = await gw.post("mute", path=path)

    assert response.status_code == 504
    record = await gw.record(response)
    assert (record.input_tokens, record.output_tokens) == (0, 0)
    assert gw.window("mute")[0] > 0  # it reached the upstream, which may have worked on it: its charge is kept


async def offer_refused(gw: Gateway) -> None:
    """The model "refused", offered through an upstream on a port nothing listens on: connections are refused."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    gw.entries["refused"] = await CatalogEntry.objects.acreate(
        public_id="refused", runner="gateway", upstream_base_url=f"http://127.0.0.1:{port}/v1", upstream_api_key="k"
    )


@BOTH
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_request_no_connection_to_the_upstream_could_carry_leaves_the_callers_windows_as_they_were(
    gw: Gateway, path: str, stream: bool
) -> None:
    await offer_refused(gw)

    response = await gw.post("refused", path=path, stream=stream)

    assert response.status_code == 502 and error_of(response)["code"] == "upstream_unavailable"
    record = await gw.record(response)
    assert (record.status, record.input_tokens, record.output_tokens) == (502, 0, 0)
    assert gw.window("refused") == (0, 0)  # its charge withdrawn, its slot free


async def test_a_request_whose_withdrawal_fails_is_recorded_all_the_same(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    await offer_refused(gw)

    async def failing(grant: Any) -> None:
        raise RuntimeError("the windows could not be told")

    monkeypatch.setattr(admission.Grant, "withdraw", failing)

    response = await gw.post("refused")

    assert response.status_code == 500  # the withdrawal's own fault
    record = await gw.record(response)
    assert (record.status, record.error_code) == (502, "upstream_unavailable")


# --- streams -----------------------------------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("extra", [b": keepalive\n\n", b"retry: 1000\n\n"], ids=["keepalive", "no-data"])
async def test_events_the_gateway_does_not_read_pass_through_and_the_stream_is_metered(
    gw: Gateway, path: str, extra: bytes
) -> None:
    await gw.offer("odd", events(*(chat_stream(extra) if path == CHAT else responses_stream(extra))))

    response, text = await gw.stream("odd", path=path)

    assert extra.decode() in text
    record = await gw.record(response)
    assert (record.status, record.error_code, record.input_tokens, record.output_tokens) == (200, "", 11, 8)
    assert gw.window("odd") == (19, 0)


@BOTH
async def test_an_event_longer_than_any_line_limit_passes_through_whole(gw: Gateway, path: str) -> None:
    text_of = "x" * 1_500_000
    long = data(chat_chunk(text_of)) if path == CHAT else response_event("response.output_text.delta", 1, delta=text_of)
    await gw.offer("long", events(*(chat_stream(long) if path == CHAT else responses_stream(long))))
    await CatalogEntry.objects.filter(public_id="long").aupdate(context_length=1_000_000)  # room for that much text

    response, text = await gw.stream("long", path=path)

    assert text_of in text
    assert (await gw.record(response)).output_tokens == 8


@BOTH
@pytest.mark.parametrize(
    "garbage",
    [b"data: {not json\n\n", b"data: [1, 2, 3]\n\n", b"data: null\n\n", b'data: "[DONE]"\n\n'],
    ids=["not-json", "a-list", "null", "a-string"],
)
async def test_data_that_is_not_a_json_object_ends_the_stream_with_an_error_and_goes_no_further(
    gw: Gateway, path: str, garbage: bytes
) -> None:
    await gw.offer("garbled", events(*(chat_stream(garbage) if path == CHAT else responses_stream(garbage))))

    response, text = await gw.stream("garbled", path=path)

    assert garbage.decode().strip() not in text
    assert stream_error(text, path)["code"] == "upstream_error"
    assert "not a JSON object" in stream_error(text, path)["message"]
    assert (await gw.record(response)).status == 502
    assert gw.window("garbled")[1] == 0


@BOTH
async def test_empty_data_and_a_done_after_the_last_event_pass_as_they_came(gw: Gateway, path: str) -> None:
    extra = b"data: \n\n"
    stream = chat_stream(extra) if path == CHAT else (*responses_stream(extra), DONE)
    await gw.offer("lenient", events(*stream))

    response, text = await gw.stream("lenient", path=path)

    await ended_whole(gw, response, text)


@BOTH
async def test_an_event_longer_than_any_answer_holds_ends_the_stream_instead_of_passing_on_unread(
    gw: Gateway, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway, "MAX_EVENT_BYTES", 100_000)
    endless_event = b'data: {"error": {"message": "' + b"x" * 150_000  # never ended, in pieces
    pieces = [endless_event[start : start + 8192] for start in range(0, len(endless_event), 8192)]
    await gw.offer("unframed", events(first_event(path), *pieces, then="stall", upstream=gw.upstream))

    response, text = await gw.stream("unframed", path=path)

    assert "xxxx" not in text
    assert "longer than 100000 bytes" in stream_error(text, path)["message"]
    assert (await gw.record(response)).error_code == "upstream_error"


@BOTH
@pytest.mark.parametrize("then", ["end", "cut"])
async def test_a_stream_that_stops_before_its_end_ends_with_an_error_and_its_slot_freed(
    gw: Gateway, path: str, then: str
) -> None:
    await gw.offer("short", events(first_event(path), then=then))

    response, text = await gw.stream("short", path=path)

    code = stream_error(text, path)["code"]
    assert code == ("upstream_error" if then == "end" else "upstream_unavailable")
    record = await gw.record(response)
    assert (record.status, record.error_code) == (502, code)
    assert gw.window("short")[1] == 0


async def test_a_line_logged_while_a_stream_is_sent_carries_its_requests_id(
    gw: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.handler.addFilter(RequestIdLogFilter())  # as the server's console handler has it
    failure = {"message": "at db-7", "type": "server_error", "param": None, "code": "overloaded"}
    await gw.offer("failing", events(data(chat_chunk("Hel")), data({"error": failure})))

    response, _ = await gw.stream("failing")

    [failed] = [record for record in caplog.records if "mid-stream" in record.getMessage()]
    assert failed.request_id == response["x-request-id"]  # type: ignore[attr-defined]


@BOTH
async def test_a_stream_cut_after_a_delta_that_names_its_last_event_still_ends_with_an_error(
    gw: Gateway, path: str
) -> None:
    # A model writing about the protocol: its text names the stream's last event, which has not come.
    mention = (
        data(chat_chunk("The stream ends with data: [DONE]"))
        if path == CHAT
        else response_event("response.output_text.delta", 0, delta='it ends with "response.completed"')
    )
    await gw.offer("meta", events(mention))

    response, text = await gw.stream("meta", path=path)

    assert stream_error(text, path)["code"] == "upstream_error"
    record = await gw.record(response)
    assert record.status == 502
    assert record.output_tokens == 9  # the 33 characters of text that went by, four a token


async def test_a_stream_cut_after_usage_that_counted_only_its_input_is_recorded_with_the_output_that_went_by(
    gw: Gateway,
) -> None:
    early = {**chat_chunk("Hello there"), "usage": {"prompt_tokens": 11, "completion_tokens": 0}}  # 11 characters
    await gw.offer("early-usage", events(data(early)))

    response, _ = await gw.stream("early-usage")

    record = await gw.record(response)
    assert (record.status, record.input_tokens, record.output_tokens) == (502, 11, 3)
    assert gw.window("early-usage")[0] == 14  # the minute's charge corrected to the same


def split_over_lines(event: bytes) -> bytes:
    """The event with its JSON data spread over several ``data:`` lines, as SSE allows."""
    head, _, payload = event.rpartition(b"data: ")
    spread = json.dumps(json.loads(payload), indent=1).encode().replace(b"\n", b"\ndata: ")
    return head + b"data: " + spread + b"\n\n"


async def test_usage_split_over_several_data_lines_is_metered_and_kept_from_a_client_that_did_not_ask(
    gw: Gateway,
) -> None:
    await gw.offer("spread", events(data(chat_chunk("Hel")), split_over_lines(data(CHAT_USAGE)), DONE))

    response, text = await gw.stream("spread")

    assert "usage" not in text and sse_data(text)[-1] == "[DONE]"
    record = await gw.record(response)
    assert (record.status, record.input_tokens, record.output_tokens) == (200, 11, 8)
    assert gw.window("spread") == (19, 0)


async def test_a_responses_usage_split_over_several_data_lines_is_metered(gw: Gateway) -> None:
    await gw.offer("spread-r", events(first_event(RESPONSES), split_over_lines(COMPLETED)))

    response, _ = await gw.stream("spread-r", path=RESPONSES)

    record = await gw.record(response)
    assert (record.status, record.input_tokens, record.output_tokens) == (200, 11, 8)
    assert gw.window("spread-r") == (19, 0)


async def test_a_chat_error_event_reaches_the_client_in_the_apis_four_fields_only(gw: Gateway) -> None:
    failure = {"message": "at db-7", "type": "server_error", "param": None, "code": "overloaded", "raw": "db-7"}
    await gw.offer("raw", events(data(chat_chunk("Hel")), data({"error": failure})))

    response, text = await gw.stream("raw")

    assert "db-7" not in text
    error = last_event(text)["error"]
    assert (set(error), error["code"]) == ({"message", "type", "param", "code"}, "overloaded")
    assert response["x-request-id"] in error["message"]
    assert (await gw.record(response)).error_code == "overloaded"


async def test_a_chat_error_event_split_over_several_data_lines_is_put_in_the_apis_words(gw: Gateway) -> None:
    failure = {"message": "at db-7", "type": "server_error", "param": None, "code": "overloaded"}
    await gw.offer("raw-spread", events(data(chat_chunk("Hel")), split_over_lines(data({"error": failure}))))

    response, text = await gw.stream("raw-spread")

    assert "db-7" not in text
    assert last_event(text)["error"]["code"] == "overloaded"
    assert (await gw.record(response)).error_code == "overloaded"


async def test_a_responses_error_and_failed_event_reach_the_client_in_the_apis_words_with_their_names(
    gw: Gateway,
) -> None:
    failed = {**RESPONSE, "status": "failed", "error": {"code": "server_error", "message": "at db-7"}}
    await gw.offer(
        "raw-r",
        events(
            first_event(RESPONSES),
            response_event("error", 1, message="at db-7", code="overloaded", param=None, raw="db-7"),
            response_event("response.failed", 2, response=failed),
        ),
    )

    response, text = await gw.stream("raw-r", path=RESPONSES)

    assert "db-7" not in text
    names = [line for line in text.split("\n") if line.startswith("event: ")]
    assert names == ["event: response.created", "event: error", "event: response.failed"]
    error, ended = (json.loads(line) for line in sse_data(text)[1:])
    assert (set(error), error["code"], error["sequence_number"]) == (
        {"type", "code", "message", "param", "sequence_number"},
        "overloaded",
        1,
    )
    assert ended["response"]["error"]["code"] == "server_error" and ended["sequence_number"] == 2
    assert (await gw.record(response)).error_code == "overloaded"


async def test_a_chat_stream_from_an_upstream_of_this_platform_says_it_went_through_the_gateway(gw: Gateway) -> None:
    node = {"route": "node"}
    await gw.offer(
        "a-node",
        events(
            data({**chat_chunk("Hel"), "b3os": node}), data({**chat_chunk("lo"), "b3os": node}), data(CHAT_USAGE), DONE
        ),
    )

    response, text = await gw.stream("a-node")

    chunks = [json.loads(line) for line in sse_data(text) if line != "[DONE]"]
    assert [chunk["b3os"] for chunk in chunks] == [{"route": "gateway"}] * 2
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks) == "Hello"


async def test_every_chat_chunk_says_it_went_through_the_gateway_however_the_upstream_framed_it(gw: Gateway) -> None:
    def chunk(content: str) -> dict[str, Any]:  # without "usage": null, as many servers send them, passed on unread
        return {name: value for name, value in chat_chunk(content).items() if name != "usage"}

    spaced = b"id: 7\ndata:   " + json.dumps(chunk("!")).encode() + b"  \n\n"
    odd = [data({**chunk("?"), "b3os": None}), data({**chunk("?"), "b3os": "upstream"})]
    await gw.offer(
        "framed",
        events(data(chunk("Hel")), split_over_lines(data(chunk("lo"))), spaced, *odd, data(CHAT_USAGE), DONE),
    )

    response, text = await gw.stream("framed")

    chunks = [json.loads(line) for line in sse_data(text) if line != "[DONE]"]
    assert [chunk["b3os"] for chunk in chunks] == [{"route": "gateway"}] * 5
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks) == "Hello!??"
    assert "id: 7\n" in text


async def test_a_responses_stream_whose_upstream_ends_after_its_error_event_still_ends_with_response_failed(
    gw: Gateway,
) -> None:
    await gw.offer(
        "error-last",
        events(first_event(RESPONSES), response_event("error", 1, message="at db-7", code="overloaded", param=None)),
    )

    response, text = await gw.stream("error-last", path=RESPONSES)

    names = [line for line in text.split("\n") if line.startswith("event: ")]
    assert names == ["event: response.created", "event: error", "event: response.failed"]
    created, error, ended = (json.loads(line) for line in sse_data(text))
    assert ended["sequence_number"] == 2 and ended["response"]["id"] == created["response"]["id"]
    assert ended["response"]["error"] == {"code": "server_error", "message": error["message"]}
    assert "db-7" not in text


@pytest.mark.parametrize(
    "failure",
    [
        data({"error": f"db at secret-host rejected key {UPSTREAM_KEY}"}),
        data({"error": [{"message": f"key {UPSTREAM_KEY}"}]}),
        b"event: error\n" + data({"message": f"key {UPSTREAM_KEY} at secret-host"}),
    ],
    ids=["error-a-string", "error-a-list", "named-error"],
)
async def test_an_error_event_in_any_shape_reaches_the_client_in_the_apis_words_only(
    gw: Gateway, failure: bytes
) -> None:
    await gw.offer("shapeless", events(data(chat_chunk("Hel")), failure, DONE))

    response, text = await gw.stream("shapeless")

    assert UPSTREAM_KEY not in text and "secret-host" not in text
    error = [json.loads(line) for line in sse_data(text) if line != "[DONE]"][1]["error"]
    assert (set(error), error["code"]) == ({"message", "type", "param", "code"}, "upstream_error")
    assert response["x-request-id"] in error["message"]
    record = await gw.record(response)
    assert (record.status, record.error_code) == (502, "upstream_error")


async def test_a_response_failed_whose_error_is_no_object_is_a_failure_in_the_apis_words(gw: Gateway) -> None:
    failed = {
        **RESPONSE,
        "status": "failed",
        "error": f"key {UPSTREAM_KEY} refused at secret-host",
        "incomplete_details": {"reason": f"secret-host said {UPSTREAM_KEY}", "raw": "secret-host"},
    }
    await gw.offer("failed-r", events(first_event(RESPONSES), response_event("response.failed", 1, response=failed)))

    response, text = await gw.stream("failed-r", path=RESPONSES)

    assert UPSTREAM_KEY not in text and "secret-host" not in text
    ended = last_event(text)["response"]
    assert ended["error"]["code"] == "upstream_error" and response["x-request-id"] in ended["error"]["message"]
    assert ended["incomplete_details"] is None  # {"reason": null} is no incomplete_details OpenAI's spec allows
    record = await gw.record(response)
    assert (record.status, record.error_code) == (502, "upstream_error")


def endless(upstream: ScriptedUpstream) -> Script:
    """A chat stream that never ends, whatever the request's output limit: a word a chunk until the reader goes."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                part = data(chat_chunk("flood "))
                writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                await writer.drain()
        except ConnectionError:
            upstream.hung_up += 1

    return script


async def test_a_stream_that_runs_past_the_requests_output_limit_is_ended_and_billed_no_more_than_the_limit(
    gw: Gateway,
) -> None:
    before = gw.upstream.hung_up
    await gw.offer("flood", endless(gw.upstream))

    response, text = await gw.stream("flood", max_tokens=5)

    error = stream_error(text, CHAT)
    assert error["code"] == "upstream_error" and "more text than the request's 5 output tokens" in error["message"]
    assert text.count("flood") < 100
    record = await gw.record(response)
    assert (record.status, record.output_tokens) == (502, 5)
    assert await until(lambda: gw.upstream.hung_up == before + 1)


@BOTH
@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 10**9, "completion_tokens": 3},
        {"prompt_tokens": 5, "completion_tokens": 50_000},
        {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 999_999}},
        {"prompt_tokens": 5, "completion_tokens": 3, "completion_tokens_details": {"reasoning_tokens": 999_999}},
    ],
    ids=["input-past-the-context", "output-past-the-limit", "cached-past-the-input", "reasoning-past-the-output"],
)
async def test_usage_the_request_could_not_have_used_is_not_believed(
    gw: Gateway, path: str, usage: dict[str, Any]
) -> None:
    if path == RESPONSES:
        usage = {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "input_tokens_details": usage.get("prompt_tokens_details"),
            "output_tokens_details": usage.get("completion_tokens_details"),
        }
        answered = {**RESPONSE, "status": "completed", "usage": usage}
    else:
        answered = {"id": "x", "object": "chat.completion", "choices": [], "usage": usage}
    await gw.offer("boastful", answer(200, answered))
    limit = {"max_tokens": 100} if path == CHAT else {"max_output_tokens": 100}

    response = await gw.post("boastful", path=path, **limit)

    assert response.status_code == 200
    record = await gw.record(response)
    reads = gateway.estimate_input_tokens(gw.body("boastful", path=path, **limit))
    assert (record.input_tokens, record.output_tokens, record.cached_tokens, record.reasoning_tokens) == (
        reads,
        0,
        0,
        0,
    )


def drip(upstream: ScriptedUpstream) -> Script:
    """A whole answer's headers, then its body a byte at a time, each in less than the read timeout."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n")
        try:
            while True:
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.2)
        except ConnectionError:
            upstream.hung_up += 1

    return script


@BOTH
async def test_a_whole_answer_sent_a_byte_at_a_time_ends_at_the_answers_time_limit(
    gw: Gateway, settings: Any, path: str
) -> None:
    settings.GATEWAY_STREAM_MAX_SECONDS = 1  # a byte comes every 0.2 s: the read timeout (1 s) is never met
    await gw.offer("dripping", drip(gw.upstream))

    response = await asyncio.wait_for(gw.post("dripping", path=path), 10)

    assert response.status_code == 504
    assert error_of(response)["code"] == "upstream_timeout"
    assert gw.window("dripping")[1] == 0


@BOTH
@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("garbage-value, 37", "1"),
        ("99999999999", "86400"),
        ("Wed, 21 Oct 2015 07:28:00 GMT", "1"),
        ("1 Jan 10000000000 00:00:00 GMT", "1"),
    ],
    ids=["garbage", "past-a-day", "a-date-gone-by", "a-date-past-any-calendar"],
)
async def test_an_upstreams_retry_after_reaches_the_client_as_seconds_it_can_read(
    gw: Gateway, path: str, given: str, expected: str
) -> None:
    await gw.offer("limited-odd", answer(429, b"<html>Too Many Requests</html>", headers={"Retry-After": given}))

    response = await gw.post("limited-odd", path=path)

    assert (response.status_code, response["Retry-After"]) == (429, expected)


@BOTH
async def test_a_stream_in_an_encoding_the_gateway_did_not_ask_for_is_a_502(gw: Gateway, path: str) -> None:
    async def gzipped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = gzip.compress(b"".join(chat_stream()))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )

    await gw.offer("zipped", gzipped)

    response = await gw.post("zipped", path=path, stream=True)

    assert response.status_code == 502
    assert "'gzip' encoding" in error_of(response)["message"]
    assert gw.window("zipped")[1] == 0


@BOTH
async def test_an_upstream_that_never_begins_its_answer_is_a_504(gw: Gateway, path: str) -> None:
    await gw.offer("mute", silence(gw.upstream))

    response = await gw.post("mute", path=path, stream=True)

    assert response.status_code == 504
    assert error_of(response)["code"] == "upstream_timeout"
    assert (await gw.record(response)).status == 504
    assert gw.window("mute")[1] == 0


@BOTH
async def test_a_stream_that_stalls_ends_with_a_timeout_and_closes_the_upstream_request(gw: Gateway, path: str) -> None:
    before = gw.upstream.hung_up
    await gw.offer("stalling", events(first_event(path), then="stall", upstream=gw.upstream))

    response, text = await gw.stream("stalling", path=path)

    assert stream_error(text, path)["code"] == "upstream_timeout"
    assert (await gw.record(response)).status == 504
    assert await until(lambda: gw.upstream.hung_up == before + 1)


@BOTH
async def test_a_stream_that_goes_silent_ends_at_its_time_limit_not_at_the_read_timeout(
    gw: Gateway, settings: Any, path: str
) -> None:
    settings.GATEWAY_STREAM_MAX_SECONDS = 1
    settings.GATEWAY_TIMEOUT_SECONDS = 5  # longer than the stream may last: its limit comes first
    await gw.offer("quiet", events(first_event(path), then="stall", upstream=gw.upstream))

    response, text = await gw.stream("quiet", path=path)

    assert stream_error(text, path)["code"] == "stream_time_limit"
    assert (await gw.record(response)).error_code == "stream_time_limit"


async def until(condition: Callable[[], bool]) -> bool:
    for _ in range(200):
        if condition():
            return True
        await asyncio.sleep(0.05)
    return False


@BOTH
async def test_a_stream_whose_key_is_revoked_ends_with_invalid_api_key_and_closes_the_upstream_request(
    gw: Gateway, settings: Any, path: str
) -> None:
    settings.GATEWAY_TIMEOUT_SECONDS = 10  # the upstream says nothing more: the revocation ends the stream first
    before = gw.upstream.hung_up
    await gw.offer("revoked", events(first_event(path), then="stall", upstream=gw.upstream))
    response = await gw.post("revoked", path=path, stream=True)
    sent: list[bytes] = []

    async def read() -> None:
        async for chunk in response.streaming_content:
            sent.append(chunk)

    reading = asyncio.create_task(read())
    await until(lambda: bool(sent))
    await APIKey.objects.filter(organization_id=gw.organization_id).aupdate(revoked_at=timezone.now())
    await asyncio.wait_for(reading, 10)

    text = b"".join(sent).decode()
    assert stream_error(text, path)["code"] == "invalid_api_key"
    if path == RESPONSES:  # as the node's own: no code that asks for a retry the key cannot get
        assert last_event(text)["response"]["error"]["code"] == "invalid_prompt"
    assert (await gw.record(response)).error_code == "invalid_api_key"
    assert await until(lambda: gw.upstream.hung_up == before + 1)


# --- clients that hang up ----------------------------------------------------------------------------------


@BOTH
async def test_a_client_that_hangs_up_mid_stream_closes_the_upstream_request_frees_its_slot_and_is_recorded_once(
    gw: Gateway, path: str
) -> None:
    before = gw.upstream.hung_up
    await gw.offer("abandoned", events(first_event(path), then="stall", upstream=gw.upstream))
    response = await gw.post("abandoned", path=path, stream=True)

    async for _ in response.streaming_content:
        break  # the client reads the first event and goes
    await response.source.aclose()  # as the server does for a client gone (config.asgi)

    assert await until(lambda: gw.upstream.hung_up == before + 1)
    record = await gw.record(response)
    assert (record.status, record.error_code) == (499, "client_disconnected")
    # Without the upstream's count: the body's estimate, and the one token of text (chat's "Hel") that went by.
    reads = gateway.estimate_input_tokens(gw.body("abandoned", path=path, stream=True))
    assert (record.input_tokens, record.output_tokens) == (reads, 1 if path == CHAT else 0)
    assert await UsageRecord.objects.filter(request_id=response["x-request-id"]).acount() == 1
    assert gw.window("abandoned")[1] == 0


def test_a_stream_cut_into_chunks_anywhere_gives_the_events_it_gives_whole() -> None:
    stream = b"data: a\r\n\r\n: keepalive\n\ndata: b\r\ndata: c\r\n\r\nevent: error\ndata: {}\n\ndata: tail"
    whole = gateway.SSEFrames()
    expected = whole.feed(stream), whole.rest()
    for size in range(1, 12):
        frames = gateway.SSEFrames()
        got = [event for start in range(0, len(stream), size) for event in frames.feed(stream[start : start + size])]
        assert (got, frames.rest()) == expected
    assert expected == ([b"data: a", b": keepalive", b"data: b\ndata: c", b"event: error\ndata: {}"], b"data: tail")


# --- framing that breaks, names that hold the key, what comes after the end ---------------------------------------


def raw(head: bytes, *parts: bytes) -> Script:
    """An answer written byte for byte: ``head`` (the status line and headers), then each of ``parts`` a moment
    apart, then the connection closed."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head)
        for part in parts:
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(part)

    return script


@BOTH
async def test_an_answer_whose_headers_do_not_parse_is_a_502_and_the_log_line_keeps_the_key_out(
    gw: Gateway, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    await gw.offer("garbled", raw(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-evil: a\rb\r\n\r\n"))

    response = await gw.post("garbled", path=path, stream=True)

    assert response.status_code == 502 and error_of(response)["code"] == "upstream_unavailable"
    assert "could not reach" in caplog.text and UPSTREAM_KEY not in caplog.text


CHUNKED = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n"


@BOTH
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_body_whose_chunks_break_after_its_headers_is_a_timeout_at_the_read_timeout_and_frees_its_slot(
    gw: Gateway, path: str, stream: bool
) -> None:
    kind = b"text/event-stream" if stream else b"application/json"
    await gw.offer("broken", raw(CHUNKED % kind, b'14\r\ndata: {"id": "chatcm\r\nzz\r\n'))

    response = await gw.post("broken", path=path, stream=stream)
    text = await read_stream(response) if stream else ""

    error = stream_error(text, path) if stream else error_of(response)
    assert error["code"] == "upstream_timeout"
    assert (await gw.record(response)).status == 504
    assert gw.window("broken")[1] == 0


@BOTH
async def test_an_upstream_key_echoed_as_an_error_events_code_or_param_is_neither_relayed_nor_recorded(
    gw: Gateway, path: str
) -> None:
    echoed = {"message": "bad key", "type": "invalid_request_error", "code": UPSTREAM_KEY, "param": UPSTREAM_KEY}
    if path == CHAT:
        failing = data({"error": echoed})
    else:
        failing = response_event("response.failed", 1, response={**RESPONSE, "status": "failed", "error": echoed})
    await gw.offer("echoing", events(first_event(path), failing))

    response, text = await gw.stream("echoing", path=path)

    assert UPSTREAM_KEY not in text
    assert (await gw.record(response)).error_code == "upstream_error"


async def test_a_whole_failed_response_whose_code_holds_the_key_is_recorded_without_it(gw: Gateway) -> None:
    failed = {**RESPONSE, "status": "failed", "error": {"code": UPSTREAM_KEY, "message": "x"}}
    await gw.offer("echoing", answer(200, failed))

    response = await gw.post("echoing", path=RESPONSES)

    assert UPSTREAM_KEY not in response.content.decode()
    assert (await gw.record(response)).error_code == "upstream_error"


async def test_a_stream_framed_with_carriage_returns_alone_is_read_as_sse_reads_it(
    gw: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    failed = {**RESPONSE, "status": "failed", "error": {"code": "server_error", "message": f"db-7 {UPSTREAM_KEY}"}}
    framed = [
        e.replace(b"\n", b"\r") for e in (first_event(RESPONSES), response_event("response.failed", 1, response=failed))
    ]
    await gw.offer("cr", events(*framed))

    response, text = await gw.stream("cr", path=RESPONSES)

    assert "db-7" not in text and UPSTREAM_KEY not in text
    names = [line for line in text.split("\n") if line.startswith("event: ")]
    assert names == ["event: response.created", "event: response.failed"]
    assert (await gw.record(response)).error_code == "server_error"


@BOTH
async def test_an_error_event_whose_name_is_written_escaped_is_put_in_the_apis_words(gw: Gateway, path: str) -> None:
    escaped = b'data: {"\\u0065rror": {"message": "at db-7", "type": "server_error", "code": "overloaded"}}\n\n'
    await gw.offer("escaped", events(first_event(path), escaped))

    response, text = await gw.stream("escaped", path=path)

    assert "db-7" not in text and stream_error(text, path)["code"] == "overloaded"
    assert (await gw.record(response)).error_code == "overloaded"


@BOTH
@pytest.mark.parametrize("body", [{}, {"choices": "x", "output": 5}], ids=["empty", "not-lists"])
async def test_a_whole_answer_without_its_choices_or_output_is_a_502(gw: Gateway, path: str, body: Any) -> None:
    await gw.offer("shapeless", answer(200, body))

    response = await gw.post("shapeless", path=path)

    assert response.status_code == 502 and error_of(response)["code"] == "upstream_error"
    assert (await gw.record(response)).status == 502


async def test_a_whole_answer_with_an_error_beside_no_choices_is_that_error(gw: Gateway) -> None:
    await gw.offer("sly", answer(200, {"error": {"message": "db-7 down", "code": "provider_down"}, "choices": []}))

    response = await gw.post("sly")

    assert response.status_code == 502 and error_of(response)["code"] == "provider_down"
    assert "db-7" not in response.content.decode()


def test_an_event_framed_with_carriage_returns_alone_is_given_as_soon_as_its_chunk_ends() -> None:
    frames = gateway.SSEFrames()

    assert frames.feed(b"data: a\r\r") == [b"data: a"]
    assert frames.feed(b"\ndata: b\r") == []  # the LF of a CRLF split across chunks ends no line of its own
    assert frames.feed(b"\n\r\n") == [b"data: b"]


@BOTH
@pytest.mark.parametrize("framing", [b"\n", b"\r"], ids=["lf", "cr"])
async def test_a_stream_whose_connection_breaks_after_its_last_event_ends_as_it_ended(
    gw: Gateway, path: str, framing: bytes
) -> None:
    parts = [part.replace(b"\n", framing) for part in (chat_stream() if path == CHAT else responses_stream())]
    await gw.offer("cut", events(*parts, then="cut"))

    response, text = await gw.stream("cut", path=path)

    await ended_whole(gw, response, text)


@BOTH
async def test_a_stream_ends_with_its_last_event_whatever_the_upstream_does_after_it(
    gw: Gateway, path: str, settings: Any
) -> None:
    settings.GATEWAY_STREAM_MAX_SECONDS = 2
    settings.GATEWAY_TIMEOUT_SECONDS = 30  # a wait after the last event would reach the stream's limit first
    before = gw.upstream.hung_up
    stream = chat_stream() if path == CHAT else responses_stream()
    await gw.offer("lingering", events(*stream, then="stall", upstream=gw.upstream))

    response, text = await gw.stream("lingering", path=path)

    await ended_whole(gw, response, text)
    assert await until(lambda: gw.upstream.hung_up == before + 1)  # its connection closed, not kept waiting


async def test_usage_that_is_not_counts_is_logged_without_any_part_of_the_key(
    gw: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    answered = {
        "id": "x",
        "object": "chat.completion",
        "choices": [],
        "usage": {"prompt_tokens": f"Bearer {UPSTREAM_KEY}"},
    }
    await gw.offer("leaky", answer(200, answered))

    await gw.post("leaky")

    assert "not token counts" in caplog.text
    assert UPSTREAM_KEY[:12] not in caplog.text and UPSTREAM_KEY[-12:] not in caplog.text
