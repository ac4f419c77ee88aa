"""The openai Node SDK, pinned as `make test` installs it, against a live server: the API reference's TypeScript
examples and what a Node client does with the answers (its stream helpers, its error classes)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MODEL_ID, ROOT, LiveServer

SDK = ROOT / "var" / "node-clients" / "node_modules" / "openai"
SCRIPT = Path(__file__).with_name("openai_node.mjs")


def node(server: LiveServer, scenario: str) -> dict[str, Any]:
    if not SDK.exists():
        pytest.fail(f"the openai Node SDK is not installed at {SDK}: `make test` installs it")
    env = {
        "PATH": os.environ["PATH"],
        "OPENAI_NODE_SDK": str(SDK),
        "B3OS_BASE_URL": server.base_url,
        "B3OS_API_KEY": server.key,
        "B3OS_MODEL": MODEL_ID,
    }
    result = subprocess.run(["node", str(SCRIPT), scenario], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_node_sdk_lists_and_retrieves_models(node_server: LiveServer) -> None:
    seen = node(node_server, "models")

    assert seen == {"listed": [MODEL_ID], "retrieved": MODEL_ID, "owned_by": "b3os"}


def test_the_node_sdk_creates_a_completion_with_its_usage(node_server: LiveServer) -> None:
    seen = node(node_server, "completion")

    assert seen["object"] == "chat.completion" and seen["content"]
    usage = seen["usage"]
    assert (
        usage["completion_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )


def test_the_node_sdk_streams_a_completion_ending_with_its_usage(node_server: LiveServer) -> None:
    seen = node(node_server, "stream")

    assert seen["text"] and seen["finish"] in ("stop", "length")
    assert seen["usage"]["completion_tokens"] > 0


def test_the_node_sdks_stream_helper_assembles_the_deltas_into_the_whole_completion(node_server: LiveServer) -> None:
    seen = node(node_server, "streamHelper")

    assert seen["content"] and seen["deltas"] == seen["content"]


def test_the_node_sdk_makes_a_tool_round_trip(node_server: LiveServer) -> None:
    seen = node(node_server, "tools")

    assert seen["name"] == "get_weather" and isinstance(seen["arguments"]["city"], str)
    assert seen["finish"] == "stop"  # as OpenAI ends a call its request named
    assert seen["answer"]


def test_the_node_sdk_gets_json_that_matches_a_strict_schema(node_server: LiveServer) -> None:
    seen = node(node_server, "schema")

    assert set(seen["parsed"]) == {"name"} and isinstance(seen["parsed"]["name"], str)


def test_the_node_sdk_reads_a_responses_output_text(node_server: LiveServer) -> None:
    seen = node(node_server, "responses")

    assert seen["output_text"] and seen["status"] in ("completed", "incomplete")
    assert seen["usage"]["output_tokens"] > 0


def test_the_node_sdks_responses_stream_helper_gets_every_event_and_the_final_response(
    node_server: LiveServer,
) -> None:
    seen = node(node_server, "responsesStream")

    assert seen["types"][0] == "response.created" and seen["types"][-1] in ("response.completed", "response.incomplete")
    assert seen["deltas"] and seen["deltas"] == seen["output_text"]


def test_the_node_sdk_makes_the_api_references_responses_tool_round_trip(node_server: LiveServer) -> None:
    seen = node(node_server, "responsesTool")

    assert seen["name"] == "get_weather" and isinstance(seen["arguments"]["city"], str)
    assert seen["answer"] and seen["status"] in ("completed", "incomplete")


def test_an_unknown_model_is_the_node_sdks_not_found_error_with_the_apis_code_and_request_id(
    node_server: LiveServer,
) -> None:
    seen = node(node_server, "error")

    assert seen["thrown"] and seen["kind"] == "NotFoundError" and seen["status"] == 404
    assert (seen["code"], seen["type"], seen["param"]) == ("model_not_available", "invalid_request_error", "model")
    assert seen["requestID"].startswith("req_")


def test_a_key_that_is_not_one_is_the_node_sdks_authentication_error(node_server: LiveServer) -> None:
    seen = node(node_server, "badKey")

    assert seen == {
        "thrown": True,
        "kind": "AuthenticationError",
        "status": 401,
        "code": "invalid_api_key",
        "type": "invalid_request_error",  # as OpenAI's own
    }
