"""Real clients against a live server: the openai SDK, and a client that hangs up mid-stream."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from openai import OpenAI
from pydantic import BaseModel

from tests.conftest import MODEL_ID, LiveServer
from tests.inference.test_chat_completions import WEATHER_TOOL


@pytest.fixture
def client(node_server: LiveServer) -> OpenAI:
    return OpenAI(api_key=node_server.key, base_url=node_server.base_url, max_retries=0, timeout=120)


def test_the_sdk_lists_and_retrieves_models(client: OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    model = client.models.retrieve(MODEL_ID)
    assert model.id == MODEL_ID and model.owned_by == "b3os"
    assert model.model_extra["b3os"]["json_schema"] is True


def test_the_sdk_creates_a_completion(client: OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "Name one river in Oregon."}],
        max_tokens=16,
        temperature=0,
    )
    assert completion.choices[0].message.content
    assert completion.usage.completion_tokens > 0


def test_the_sdk_streams_a_completion_with_usage(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "Name one river in Oregon."}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage.completion_tokens > 0


def test_the_sdk_parses_into_a_pydantic_model(client: OpenAI) -> None:
    class City(BaseModel):
        name: str
        state: str

    completion = client.chat.completions.parse(
        model=MODEL_ID,
        # Told the shape, the 135M model answers in a few tokens instead of writing on inside the name.
        messages=[
            {"role": "system", "content": "Reply with the city's name and its state, in JSON."},
            {"role": "user", "content": "Name a city in Oregon."},
        ],
        response_format=City,
        max_tokens=60,
        temperature=0,
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_the_sdk_sends_back_a_parsed_message_as_the_conversations_next_turn(client: OpenAI) -> None:
    class City(BaseModel):
        name: str

    messages: list[Any] = [{"role": "user", "content": "Name a city in Oregon, in JSON."}]
    parsed = client.chat.completions.parse(
        model=MODEL_ID, messages=messages, response_format=City, max_tokens=30, temperature=0
    )
    with client.chat.completions.stream(
        model=MODEL_ID, messages=messages, response_format=City, max_tokens=30, temperature=0
    ) as stream:
        streamed = stream.get_final_completion()

    # The messages as the helpers return them, their ``parsed`` answer with them, go back as they are.
    for message in (parsed.choices[0].message, streamed.choices[0].message):
        follow = client.chat.completions.with_raw_response.create(
            model=MODEL_ID,
            messages=[*messages, message, {"role": "user", "content": "Another one."}],
            max_tokens=8,
            temperature=0,
        )
        assert "parsed" in json.loads(follow.http_request.content)["messages"][1]
        assert follow.parse().choices[0].message.content is not None


def test_the_sdk_runs_a_tool_round_trip(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Eugene, Oregon?"}]
    first = client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=60, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert "city" in json.loads(call.function.arguments)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "52F and raining"},
    ]
    answer = client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=[WEATHER_TOOL], max_tokens=40, temperature=0
    )
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


# A streamed answer that runs long, unless something ends it.
LONG_STORY = {
    "model": MODEL_ID,
    "messages": [{"role": "user", "content": "Write a very long story about rivers."}],
    "max_tokens": 2000,
    "temperature": 0.9,
    "stream": True,
}


# Held to a long array: the answer cannot end on its own before something ends it (the model may end a story early).
HELD_OPEN = {
    **LONG_STORY,
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "numbers", "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 1000}},
    },
}


def recorded(server: LiveServer, request_id: str, columns: str) -> tuple[Any, ...]:
    """The usage record's ``columns``, once the server has written it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if rows := server.query(f"select {columns} from inference_usagerecord where request_id = ?", request_id):
            return rows[0]
        time.sleep(0.2)
    raise AssertionError(f"request {request_id} left no usage record")


def test_a_key_revoked_mid_stream_ends_the_stream_with_invalid_api_key_and_its_usage_is_recorded(
    node_server: LiveServer,
) -> None:
    key = node_server.new_key("revoked-mid-stream")
    events: list[dict[str, Any]] = []
    headers = {"Authorization": f"Bearer {key}"}
    with (
        httpx.Client(base_url=node_server.url, headers=headers, timeout=60) as http,
        http.stream("POST", "/v1/infer/chat/completions", json=HELD_OPEN) as response,
    ):
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if len(events) == 3:
                node_server.manage("revoke_key", key)  # another process: the server learns of it as it would

    *chunks, last = events
    assert last["error"]["code"] == "invalid_api_key" and "revoked" in last["error"]["message"]
    assert all("choices" in chunk for chunk in chunks)
    error_code, output_tokens = recorded(node_server, request_id, "error_code, output_tokens")
    assert error_code == "invalid_api_key" and 0 < output_tokens < 2000


def test_a_client_that_hangs_up_stops_generation_and_is_recorded(node_server: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {node_server.key}"}
    with httpx.Client(base_url=node_server.url, headers=headers, timeout=60) as http:
        # The same prompt once before: the cut stream finds it cached, and its record says so.
        once = {**LONG_STORY, "stream": False, "max_tokens": 1}
        assert http.post("/v1/infer/chat/completions", json=once).is_success
        with http.stream("POST", "/v1/infer/chat/completions", json=LONG_STORY) as response:
            request_id = response.headers["x-request-id"]
            lines = 0
            for line in response.iter_lines():
                lines += line.startswith("data: ")
                if lines >= 5:
                    break
        # The model is free again at once: the abandoned job does not run on to 2000 tokens.
        started = time.monotonic()
        quick = http.post(
            "/v1/infer/chat/completions",
            json={"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
        assert quick.status_code == 200
        assert time.monotonic() - started < 10
    columns = "status, error_code, output_tokens, input_tokens, cached_tokens"
    status, error_code, output_tokens, input_tokens, cached_tokens = recorded(node_server, request_id, columns)
    assert (status, error_code) == (499, "client_disconnected")
    assert 3 <= output_tokens < 2000
    assert 0 < cached_tokens < input_tokens
