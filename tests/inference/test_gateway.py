"""The gateway route against a real local upstream server."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.models import CatalogEntry
from tests.conftest import (
    API,
    MODEL_ID,
    ROOT,
    LiveServer,
    free_port,
    start_server,
    stop_server,
    wait_for_http,
    wait_until,
)
from tests.fakes.openai_upstream import CHUNK_WORDS

UPSTREAM_KEY = "upstream-secret-123456"
QUESTION = [{"role": "user", "content": "Hi"}]


@dataclass
class Setup:
    server: LiveServer
    upstream_url: str

    def post(self, body: dict, *, path: str = "/v1/infer/chat/completions", key: str | None = None) -> httpx.Response:
        return httpx.post(
            self.server.url + path, json=body, headers={"Authorization": f"Bearer {key or self.server.key}"}, timeout=30
        )

    def log(self) -> str:
        return (self.server.db_path.parent / "server.log").read_text()

    def last(self) -> dict:
        return httpx.get(self.upstream_url + "/last", timeout=5).json()

    def usage(self, request_id: str) -> tuple:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            rows = self.server.query(
                "select route, status, error_code, input_tokens, output_tokens, model from inference_usagerecord "
                "where request_id = ?",
                request_id,
            )
            if rows:
                return rows[0]
            time.sleep(0.1)
        raise AssertionError(f"no usage record for {request_id}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.openai_upstream", "--port", str(port), "--api-key", UPSTREAM_KEY], cwd=ROOT
    )
    upstream_url = f"http://127.0.0.1:{port}"
    wait_for_http(upstream_url + "/last", process=upstream)
    server = start_server(
        tmp_path_factory.mktemp("gateway"),
        extra_env={
            "GATEWAY_BASE_URL": upstream_url + "/v1",
            "GATEWAY_API_KEY": UPSTREAM_KEY,
            "GATEWAY_TIMEOUT_SECONDS": "2",
            "GATEWAY_STREAM_MAX_SECONDS": "3",
            "HTTP_TIMEOUT_SECONDS": "4",
            "GATEWAY_MAX_RESPONSE_BYTES": "200000",
        },
        org="gw",
    )
    # The upstream's models this node offers through the gateway; the fake upstream's names pick its behaviour.
    server.manage("add_gateway_model", "upstream/gpt-x", "--allow", "n,stored_objects")
    server.manage(
        "add_gateway_model",
        "slow",
        "error-400",
        "error-429",
        "error-500-text",
        "stall",
        "trickle",
        "upstream/plain",
        "bad-usage",
        "crlf",
        "error-midstream",
        "no-done",
        "redirect",
        "huge",
    )
    yield Setup(server=server, upstream_url=upstream_url)
    stop_server(server)
    upstream.terminate()


def chat(model: str = "upstream/gpt-x", **extra: object) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Name one river in Oregon."}],
        "route": "gateway",
        **extra,
    }


def assert_no_upstream_secret(response: httpx.Response) -> None:
    assert UPSTREAM_KEY not in response.text
    assert all(UPSTREAM_KEY not in value for value in response.headers.values())


def test_a_model_the_node_does_not_serve_points_to_the_gateway(setup: Setup) -> None:
    response = setup.post({**chat(), "route": None})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_available"
    assert '"route": "gateway"' in response.json()["error"]["message"]
    # The models list says so too.
    listed = httpx.get(
        setup.server.url + "/v1/infer/models", headers={"Authorization": f"Bearer {setup.server.key}"}, timeout=30
    ).json()
    routes = {model["id"]: model["b3os"]["route"] for model in listed["data"]}
    assert (routes["upstream/gpt-x"], routes[MODEL_ID]) == ("gateway", "node")


def test_it_forwards_a_request_and_says_which_way_it_went(setup: Setup) -> None:
    response = setup.post(chat(n=2, logit_bias={"1": 1}))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "The Willamette River flows north through Oregon."
    assert body["b3os"]["route"] == "gateway"
    assert 'infer_route;desc="gateway"' in response.headers["server-timing"]
    sent = setup.last()
    assert sent["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert "route" not in sent["body"] and sent["body"]["n"] == 2
    assert_no_upstream_secret(response)
    route, status, code, input_tokens, output_tokens, model = setup.usage(response.headers["x-request-id"])
    assert (route, status, code, input_tokens, output_tokens, model) == ("gateway", 200, "", 11, 8, "upstream/gpt-x")


def test_node_requests_say_they_stayed_on_the_node(setup: Setup) -> None:
    response = setup.post({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert response.json()["b3os"]["route"] == "node"
    assert 'infer_route;desc="node"' in response.headers["server-timing"]


def test_it_passes_a_stream_through_and_records_its_usage(setup: Setup) -> None:
    with httpx.stream(
        "POST",
        setup.server.url + "/v1/infer/chat/completions",
        json=chat(stream=True, stream_options={"include_usage": True}),
        headers={"Authorization": f"Bearer {setup.server.key}"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        request_id = response.headers["x-request-id"]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == (
        "The Willamette River flows north through Oregon."
    )
    assert setup.usage(request_id)[:5] == ("gateway", 200, "", 11, 8)


def test_the_responses_endpoint_forwards_too(setup: Setup) -> None:
    response = setup.post({"model": "upstream/gpt-x", "input": "Hi", "route": "gateway"}, path="/v1/infer/responses")
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["text"].startswith("The Willamette")
    assert response.json()["b3os"]["route"] == "gateway"
    assert setup.last()["path"] == "/v1/responses"


def test_limits_apply_to_gateway_traffic(setup: Setup) -> None:
    key = setup.server.new_key("gw-limited")
    setup.server.manage("set_limit", "gw-limited", "--rpm", "2")
    statuses = [setup.post(chat(), key=key).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]


def test_an_upstream_error_keeps_its_status_code_and_param_and_its_words_go_to_the_log_only(setup: Setup) -> None:
    response = setup.post(chat(model="error-400"))
    request_id = response.headers["x-request-id"]
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"The gateway refused the request with status 400 (upstream_refused). Quote the request id "
        f"{request_id} when you report it.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "upstream_refused",
    }
    assert setup.usage(request_id)[1:3] == (400, "upstream_refused")
    logged = [line for line in setup.log().splitlines() if request_id in line]
    assert any("Upstream says no." in line for line in logged)


def test_an_upstream_failure_without_a_body_is_a_502_logged_under_its_request_id(setup: Setup) -> None:
    response = setup.post(chat(model="error-500-text"))
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_error"
    # Django's own line for the response, logged after the request's middleware is done, names it too.
    request_id = response.headers["x-request-id"]
    assert wait_until(lambda: f"ERROR django.request [{request_id}] Bad Gateway" in setup.log())


def test_a_slow_upstream_times_out_with_a_504(setup: Setup) -> None:
    started = time.monotonic()
    response = setup.post(chat(model="slow", metadata={"delay": "30"}))
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    assert time.monotonic() - started < 10


def test_an_upstream_that_is_down_is_a_502(setup: Setup) -> None:
    dead = free_port()
    setup.server.query(
        "insert into inference_catalogentry (public_id, runner, runner_settings, context_length, max_output_tokens, "
        "json_schema, image_input, tools, reasoning, enabled, owned_by, created, upstream_base_url, upstream_api_key, "
        "upstream_model, gateway_parameters, sampling_defaults) values ('proxied/down', 'gateway', '{}', 8192, 1024, "
        "1, 0, 1, 0, 1, 'b3os', '2026-01-01 00:00:00', ?, 'k', 'x', '[]', '{}')",
        f"http://127.0.0.1:{dead}/v1",
    )
    response = setup.post(chat(model="proxied/down"))
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unavailable"
    assert_no_upstream_secret(response)
    # The client is given the id to quote, and the log holds the cause under it.
    request_id = response.headers["x-request-id"]
    assert request_id in response.json()["error"]["message"]
    assert wait_until(lambda: f"could not reach 127.0.0.1 for request {request_id}" in setup.log())


def read_estimate(body: dict) -> int:
    """What the gateway reckons a body it forwards to hold without the upstream's count: four bytes a token."""
    return len(json.dumps(body, separators=(",", ":"))) // 4


def text_tokens(texts: list[str]) -> int:
    """What the gateway reckons streamed pieces of text to hold without the upstream's count: four characters a
    token, at least one a piece."""
    return sum(max(1, -(-len(text) // 4)) for text in texts if text)


def streamed_texts(lines: list[str]) -> list[str]:
    """The text of each streamed chat chunk."""
    return [c["delta"].get("content") or "" for line in lines if line != "[DONE]" for c in json.loads(line)["choices"]]


def test_a_client_that_hangs_up_closes_the_upstream_request_and_is_recorded_with_what_it_got(setup: Setup) -> None:
    before = setup.last().get("abandoned_streams", 0)
    body = chat(model="stall", stream=True)
    with httpx.stream(
        "POST",
        setup.server.url + "/v1/infer/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {setup.server.key}"},
        timeout=30,
    ) as response:
        request_id = response.headers["x-request-id"]
        for count, _ in enumerate(response.iter_lines()):
            if count >= 2:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and setup.last().get("abandoned_streams", 0) == before:
        time.sleep(0.1)
    assert setup.last()["abandoned_streams"] == before + 1
    # The upstream never said what it used: the record holds the body's estimate and the two pieces of text it sent.
    assert setup.usage(request_id)[1:5] == (
        499,
        "client_disconnected",
        read_estimate(body),
        text_tokens(CHUNK_WORDS[:2]),
    )


@pytest.mark.django_db(transaction=True)
async def test_without_a_configured_gateway_the_route_is_refused(api: API, settings: Any) -> None:
    settings.GATEWAY_BASE_URL = ""
    await CatalogEntry.objects.acreate(public_id="upstream/gpt-x", runner="gateway")

    response = await api.post("/v1/infer/chat/completions", chat())

    assert response.status_code == 503
    assert response.json()["error"]["code"] == "gateway_not_configured"


@pytest.mark.django_db(transaction=True)
async def test_an_upstream_url_saved_before_the_catalog_checked_it_is_refused_not_a_server_error(
    api: API, caplog: pytest.LogCaptureFixture
) -> None:
    # aiohttp refuses a URL with credentials beside a key (a 500), and would log the password of one without.
    await CatalogEntry.objects.acreate(
        public_id="upstream/gpt-x",
        runner="gateway",
        upstream_base_url="https://user:s3cret@upstream.example/v1",
        upstream_api_key="sk-x",
    )

    response = await api.post("/v1/infer/chat/completions", chat())

    assert response.status_code == 503
    assert response.json()["error"]["code"] == "gateway_not_configured"
    assert "it holds credentials" in caplog.text and "s3cret" not in caplog.text


# --- which models, and what of them, the operator offers -----------------------------------------------------


def test_a_model_outside_the_catalog_is_refused_not_forwarded(setup: Setup) -> None:
    before = setup.last()
    response = setup.post(chat(model="made-up/model"))

    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_available"
    assert response.json()["error"]["param"] == "model"
    assert setup.last() == before


@pytest.mark.parametrize(("model", "code"), [(123, "invalid_type"), (None, "invalid_type"), ("", "invalid_value")])
def test_a_gateway_model_that_is_not_a_name_is_named_as_such(setup: Setup, model: object, code: str) -> None:
    response = setup.post(chat(model=model))

    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == ("model", code)
    assert response.json() == setup.post(chat(model=model, route="node")).json()  # in the node's words


def test_a_disabled_gateway_model_is_refused_not_forwarded(setup: Setup) -> None:
    setup.server.manage("add_gateway_model", "upstream/retired", "--disable")
    before = setup.last()
    response = setup.post(chat(model="upstream/retired"))

    assert response.status_code == 404
    assert setup.last() == before


def test_a_gateway_model_is_not_served_by_the_node(setup: Setup) -> None:
    response = setup.post({**chat(), "route": None})

    assert response.status_code == 404
    assert '"route": "gateway"' in response.json()["error"]["message"]


# Every organization shares the upstream's account: an id would reach whatever it names there.
STORED_FILE = {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-abc"}}]}]}


@pytest.mark.parametrize(
    ("extra", "path", "param"),
    [
        ({"n": 2}, "/v1/infer/chat/completions", "n"),
        ({"store": True}, "/v1/infer/chat/completions", "store"),
        ({"web_search_options": {}}, "/v1/infer/chat/completions", "web_search_options"),
        ({"background": True}, "/v1/infer/responses", "background"),
        ({"tools": [{"type": "web_search"}]}, "/v1/infer/responses", "tools.0.type"),
        ({"previous_response_id": "resp_of_another_tenant"}, "/v1/infer/responses", "previous_response_id"),
        ({"conversation": "conv_1"}, "/v1/infer/responses", "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "/v1/infer/responses", "prompt"),
        ({"input": [{"type": "item_reference", "id": "msg_abc"}]}, "/v1/infer/responses", "input.0"),
        ({"input": [{"id": "msg_abc"}]}, "/v1/infer/responses", "input.0"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-abc"}]}]},
            "/v1/infer/responses",
            "input.0.content.0.file_id",
        ),
        (STORED_FILE, "/v1/infer/chat/completions", "messages.0.content.0.file.file_id"),
    ],
    ids=[
        *("n", "store", "web-search", "background", "hosted-tool", "a-stored-response", "a-stored-conversation"),
        *("a-stored-prompt", "a-stored-item", "a-stored-item-by-id-alone", "a-stored-file", "a-stored-file-in-chat"),
    ],
)
def test_what_the_node_refuses_is_refused_on_the_gateway_unless_the_entry_allows_it(
    setup: Setup, extra: dict, path: str, param: str
) -> None:
    body = (
        chat(model="upstream/plain")
        if path.endswith("completions")
        else {"model": "upstream/plain", "input": "Hi", "route": "gateway"}
    )
    before = setup.last()
    response = setup.post({**body, **extra}, path=path)

    assert response.status_code == 400, response.text
    assert response.json()["error"] | {"message": ""} == {
        "message": "",
        "type": "invalid_request_error",
        "param": param,
        "code": "unsupported_parameter",
    }
    assert setup.last() == before


@pytest.mark.parametrize(
    ("extra", "path", "param", "code"),
    [
        ({"stream": "false"}, "/v1/infer/chat/completions", "stream", "invalid_type"),
        ({"stream_options": "usage"}, "/v1/infer/chat/completions", "stream_options", "invalid_type"),
        ({"max_tokens": "10"}, "/v1/infer/chat/completions", "max_tokens", "invalid_type"),
        ({"max_completion_tokens": -1}, "/v1/infer/chat/completions", "max_completion_tokens", None),
        ({"messages": "Hi"}, "/v1/infer/chat/completions", "messages", "invalid_type"),
        ({"messages": []}, "/v1/infer/chat/completions", "messages", "empty_array"),
        ({"messages": None}, "/v1/infer/chat/completions", "messages", None),
        ({"stream": 1}, "/v1/infer/responses", "stream", "invalid_type"),
        ({"max_output_tokens": "5"}, "/v1/infer/responses", "max_output_tokens", "invalid_type"),
        ({"input": 5}, "/v1/infer/responses", "input", None),
    ],
)
def test_what_the_gateway_reads_of_a_body_is_checked_before_anything_reaches_the_upstream(
    setup: Setup, extra: dict, path: str, param: str, code: str | None
) -> None:
    body = chat(model="upstream/plain") if path.endswith("completions") else {"model": "upstream/plain", "input": "Hi"}
    before = setup.last()

    response = setup.post({**body, "route": "gateway", **extra}, path=path)

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert code is None or error["code"] == code
    assert setup.last() == before


def test_an_entry_that_allows_stored_objects_forwards_a_file_by_its_id(setup: Setup) -> None:
    response = setup.post({**chat(model="upstream/gpt-x"), **STORED_FILE})

    assert response.status_code == 200, response.text
    assert setup.last()["body"]["messages"] == STORED_FILE["messages"]


def test_responses_sent_upstream_are_not_stored_there_unless_the_entry_allows_it(setup: Setup) -> None:
    response = setup.post({"model": "upstream/plain", "input": "Hi", "route": "gateway"}, path="/v1/infer/responses")

    assert response.status_code == 200
    assert setup.last()["body"]["store"] is False


def test_made_up_model_names_neither_reach_the_upstream_nor_grow_the_metrics(setup: Setup) -> None:
    def metrics() -> bytes:
        return httpx.get(setup.server.url + "/metrics", timeout=10).content

    before = len(metrics())
    statuses = {setup.post(chat(model=f"made-up/{index}-" + "m" * 300)).status_code for index in range(50)}
    statuses |= {setup.post(chat(model=f"made-up/{index}")).status_code for index in range(50)}

    assert statuses == {400, 404}
    assert len(metrics()) < before + 2000


# --- metering what passes through ---------------------------------------------------------------------------


def stream_lines(setup: Setup, body: dict) -> tuple[list[str], str]:
    with httpx.stream(
        "POST",
        setup.server.url + "/v1/infer/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {setup.server.key}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")], response.headers[
            "x-request-id"
        ]


def test_a_stream_without_include_usage_is_metered_and_its_client_sees_no_usage(setup: Setup) -> None:
    lines, request_id = stream_lines(setup, chat(stream=True))

    chunks = [json.loads(line) for line in lines[:-1]]
    assert lines[-1] == "[DONE]"
    assert all("usage" not in chunk and chunk["choices"] for chunk in chunks)
    assert setup.last()["body"]["stream_options"] == {"include_usage": True}
    assert setup.usage(request_id)[:5] == ("gateway", 200, "", 11, 8)


@pytest.mark.parametrize("include_usage", [False, True])
def test_every_chunk_of_a_gateway_stream_says_which_way_it_went_as_the_nodes_do(
    setup: Setup, include_usage: bool
) -> None:
    lines, _ = stream_lines(setup, chat(stream=True, stream_options={"include_usage": include_usage}))
    node, _ = stream_lines(setup, {"model": MODEL_ID, "messages": QUESTION, "max_tokens": 2, "stream": True})

    chunks = [json.loads(line) for line in lines[:-1]]
    assert len(chunks) > 1 and {chunk["b3os"]["route"] for chunk in chunks} == {"gateway"}
    assert {json.loads(line)["b3os"]["route"] for line in node[:-1]} == {"node"}
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])


def test_a_stream_with_include_usage_passes_the_usage_on(setup: Setup) -> None:
    lines, _ = stream_lines(setup, chat(stream=True, stream_options={"include_usage": True}))

    chunks = [json.loads(line) for line in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 19
    assert all(chunk["usage"] is None for chunk in chunks[:-1])


def test_the_tokens_per_minute_charge_is_corrected_to_the_upstreams_count(setup: Setup) -> None:
    key = setup.server.new_key("gw-tpm")
    # Admission charges an estimate: the body's size and the default output limit, 4096 tokens. The upstream then
    # reports 19: were the estimate kept, the second request would not fit the minute.
    setup.server.manage("set_limit", "gw-tpm", "--tpm", "4200")
    statuses = [setup.post(chat(), key=key).status_code for _ in range(3)]

    assert statuses == [200, 200, 200]


def test_a_gateway_stream_ends_at_its_time_limit(setup: Setup) -> None:
    started = time.monotonic()
    body = chat(model="trickle", stream=True)
    lines, request_id = stream_lines(setup, body)

    assert time.monotonic() - started < 10  # the upstream would go on for a minute
    assert json.loads(lines[-1])["error"]["code"] == "stream_time_limit"
    assert setup.usage(request_id)[1:5] == (
        200,
        "stream_time_limit",
        read_estimate(body),
        text_tokens(streamed_texts(lines[:-1])),
    )


def test_a_request_whose_answer_does_not_begin_in_time_is_a_json_504(setup: Setup) -> None:
    # A non-streamed answer held to a long JSON array: it cannot begin before HTTP_TIMEOUT_SECONDS (4).
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 1000, "maxItems": 1000}
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": 2000,
        "response_format": {"type": "json_schema", "json_schema": {"name": "numbers", "schema": schema}},
    }
    started = time.monotonic()
    response = setup.post(body)

    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    assert response.headers["Server-Timing"].startswith("total;dur=")
    assert time.monotonic() - started < 12
    # Its usage is recorded as the 504 the client got, under the id it was given, not as the client's hang-up.
    assert setup.usage(response.headers["x-request-id"])[:3] == ("node", 504, "timeout")
    # A stream begins at once, and is never cut by that timeout however long it runs.
    lines, _ = stream_lines(setup, {"model": MODEL_ID, "messages": QUESTION, "max_tokens": 2, "stream": True})
    assert lines[-1] == "[DONE]"


def test_bodies_are_asked_for_uncompressed_as_they_are_relayed_undecoded(setup: Setup) -> None:
    assert setup.post(chat()).status_code == 200
    assert setup.last()["accept_encoding"] == "identity"


def test_usage_the_upstream_reports_in_words_is_not_trusted_and_the_answer_still_arrives(setup: Setup) -> None:
    body = chat(model="bad-usage", max_tokens=7)
    response = setup.post(body)

    assert response.status_code == 200
    route, status, error_code, input_tokens, output_tokens, _ = setup.usage(response.headers["x-request-id"])
    # Recorded with estimates instead: the body's bytes, and the answer's 48 characters at four a token, 12, but
    # no more than the request's limit of 7.
    assert (route, status, error_code, input_tokens, output_tokens) == ("gateway", 200, "", read_estimate(body), 7)
    assert "not token counts" in setup.log()


def test_admission_estimates_the_whole_body_not_only_its_messages(setup: Setup) -> None:
    key = setup.server.new_key("gw-estimate")
    setup.server.manage("set_limit", "gw-estimate", "--tpm", "20000")
    body = {"model": "upstream/gpt-x", "route": "gateway", "input": "hi", "instructions": "x" * 400_000}

    response = setup.post(body, path="/v1/infer/responses", key=key)

    assert response.status_code == 429
    assert "can never fit" in response.json()["error"]["message"]


def test_an_upstream_429_is_a_rate_limit_error_that_says_when_to_come_back(setup: Setup) -> None:
    response = setup.post(chat(model="error-429"))

    assert response.status_code == 429
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert response.headers["Retry-After"] == "1"


def stream_events(setup: Setup, body: dict) -> tuple[httpx.Response, list[str]]:
    with httpx.stream(
        "POST",
        setup.server.url + "/v1/infer/chat/completions",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {setup.server.key}"},
        timeout=30,
    ) as response:
        text = response.read().decode()
    return response, [event for event in text.split("\n\n") if event.strip()]


def test_an_upstream_stream_framed_with_crlf_streams_and_is_metered(setup: Setup) -> None:
    response, events = stream_events(setup, chat(model="crlf"))

    assert events[-1] == "data: [DONE]"
    assert all("usage" not in event for event in events)  # the client did not ask for it
    assert setup.usage(response.headers["x-request-id"])[3:5] == (11, 8)


def test_an_upstreams_error_mid_stream_reaches_the_client_in_the_apis_words(setup: Setup) -> None:
    response, events = stream_events(setup, chat(model="error-midstream"))

    error = json.loads(events[-1].removeprefix("data: "))["error"]
    request_id = response.headers["x-request-id"]
    assert error["code"] == "overloaded" and request_id in error["message"]
    assert "internal-7" not in error["message"] and "internal-7" in setup.log()
    assert setup.usage(request_id)[1:3] == (502, "overloaded")


def test_an_upstream_stream_that_stops_before_its_end_ends_with_an_error(setup: Setup) -> None:
    response, events = stream_events(setup, chat(model="no-done"))

    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == ("upstream_error", "server_error")
    assert setup.usage(response.headers["x-request-id"])[1:3] == (502, "upstream_error")


def stream_response(setup: Setup, model: str) -> tuple[httpx.Response, list[tuple[str, dict]]]:
    """A streamed Response through the gateway, as (event name, data) pairs."""
    with httpx.stream(
        "POST",
        setup.server.url + "/v1/infer/responses",
        json={"model": model, "route": "gateway", "input": "Hi", "stream": True},
        headers={"Authorization": f"Bearer {setup.server.key}"},
        timeout=30,
    ) as response:
        text = response.read().decode()
    pairs = [event.split("\n") for event in text.split("\n\n") if event.strip()]
    return response, [(name.removeprefix("event: "), json.loads(data.removeprefix("data: "))) for name, data in pairs]


def test_a_streamed_response_passes_through_and_is_metered(setup: Setup) -> None:
    response, events = stream_response(setup, "upstream/gpt-x")

    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert [name for name, _ in events][-1] == "response.completed"
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert deltas == "The Willamette River flows north through Oregon."
    assert setup.usage(response.headers["x-request-id"])[:5] == ("gateway", 200, "", 11, 8)


def test_a_responses_stream_that_stops_before_its_end_ends_with_an_error_event_and_response_failed(
    setup: Setup,
) -> None:
    response, events = stream_response(setup, "no-done")

    (*before, (name, event), (last, failed)) = events
    assert name == "error"
    assert (event["type"], event["code"]) == ("error", "upstream_error")
    assert event["sequence_number"] == before[-1][1]["sequence_number"] + 1
    # As the node ends its own: the Response the upstream began, failed, so that clients waiting for an ending get one.
    assert (last, failed["sequence_number"]) == ("response.failed", event["sequence_number"] + 1)
    assert failed["response"]["id"] == before[0][1]["response"]["id"] and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": event["message"]}
    deltas = text_tokens([event["delta"] for name, event in before if name == "response.output_text.delta"])
    body = {"model": "no-done", "route": "gateway", "input": "Hi", "stream": True}  # as stream_response sends it
    assert setup.usage(response.headers["x-request-id"])[1:5] == (502, "upstream_error", read_estimate(body), deltas)


def test_an_upstream_redirect_is_not_followed(setup: Setup) -> None:
    response = setup.post(chat(model="redirect"))

    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_error"
    assert setup.last()["path"] != "/elsewhere"


def test_an_upstream_answer_past_the_bound_is_a_502_not_read_whole(setup: Setup) -> None:
    response = setup.post(chat(model="huge"))

    assert response.status_code == 502
    assert "larger than 200000 bytes" in response.json()["error"]["message"]
    assert setup.usage(response.headers["x-request-id"])[1:3] == (502, "upstream_error")


def test_a_server_told_to_stop_closes_its_connections_to_upstreams(setup: Setup, tmp_path: Path) -> None:
    server = start_server(
        tmp_path / "var",
        extra_env={"GATEWAY_BASE_URL": setup.upstream_url + "/v1", "GATEWAY_API_KEY": UPSTREAM_KEY},
        org="gw",
    )
    server.manage("add_gateway_model", "upstream/gpt-x")
    headers = {"Authorization": f"Bearer {server.key}"}
    assert httpx.post(f"{server.base_url}/chat/completions", json=chat(), headers=headers, timeout=30).is_success

    server.process.send_signal(signal.SIGTERM)

    assert server.process.wait(timeout=60) == 0
    assert "Unclosed client session" not in (tmp_path / "var" / "server.log").read_text()
