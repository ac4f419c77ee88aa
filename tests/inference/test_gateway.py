"""The gateway route against a real local upstream server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.conftest import MODEL_ID, ROOT, LiveServer, free_port, start_server, stop_server, wait_for_http

UPSTREAM_KEY = "upstream-secret-123456"


@dataclass
class Setup:
    server: LiveServer
    upstream_url: str

    def post(self, body: dict, *, path: str = "/v1/infer/chat/completions", key: str | None = None) -> httpx.Response:
        return httpx.post(
            self.server.url + path, json=body, headers={"Authorization": f"Bearer {key or self.server.key}"}, timeout=30
        )

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
        },
        org="gw",
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
    setup.server.manage("create_org", "gw-limited")
    key = setup.server.manage("create_key", "gw-limited").strip()
    setup.server.manage("set_limit", "gw-limited", "--rpm", "2")
    statuses = [setup.post(chat(), key=key).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]


def test_an_upstream_error_body_comes_back_in_the_api_shape(setup: Setup) -> None:
    response = setup.post(chat(model="error-400"))
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "Upstream says no.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "upstream_refused",
    }
    assert setup.usage(response.headers["x-request-id"])[1:3] == (400, "upstream_refused")


def test_an_upstream_failure_without_a_body_is_a_502(setup: Setup) -> None:
    response = setup.post(chat(model="error-500-text"))
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_error"


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
        "upstream_model) values ('proxied/down', 'llama_cpp', '{}', 8192, 1024, 1, 0, 1, 0, 1, 'b3os', "
        "'2026-01-01 00:00:00', ?, 'k', 'x')",
        f"http://127.0.0.1:{dead}/v1",
    )
    response = setup.post(chat(model="proxied/down"))
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unavailable"
    assert_no_upstream_secret(response)


def test_a_client_that_hangs_up_closes_the_upstream_request(setup: Setup) -> None:
    before = setup.last().get("abandoned_streams", 0)
    with httpx.stream(
        "POST",
        setup.server.url + "/v1/infer/chat/completions",
        json=chat(model="stall", stream=True),
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
    assert setup.usage(request_id)[1:3] == (499, "client_disconnected")


def test_without_a_configured_gateway_the_route_is_refused(node_server: LiveServer) -> None:
    response = httpx.post(
        node_server.url + "/v1/infer/chat/completions",
        json=chat(),
        headers={"Authorization": f"Bearer {node_server.key}"},
        timeout=10,
    )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "gateway_not_configured"
