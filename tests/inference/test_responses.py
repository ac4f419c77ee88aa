"""POST /v1/infer/responses in this process: the stateless Responses API, its refusals, and its event stream.

Answers come from SmolLM2 on the CPU runner. Forced tool calls, structured output, reasoning and a
failure mid-stream come from a reasoning model on the TensorRT-LLM stand-in (``tests/fakes``), whose
engine echoes the prompt's words (or writes a minimal instance of a guided schema): deterministic,
and fast where the CPU runner's grammar-constrained decoding is slow.
"""

from __future__ import annotations

import codecs
import importlib
import json
import sys
import types
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import jinja2
import pytest

from inference.engine import execution
from inference.engine.generation import Generation
from inference.engine.runners import tensorrt_llm as tensorrt_llm_runner
from inference.models import CatalogEntry, UsageRecord
from inference.openai.responses import INCLUDE_LOGPROBS, OPENAI_ITEM_TYPES, OPENAI_TOOL_TYPES, ResponseCreateRequest
from inference.openai.shared import parse
from inference.serving import responses
from inference.usage.records import flush
from tests.conftest import API, MODEL_ID, OpenAISpec, read_stream

pytestmark = pytest.mark.django_db(transaction=True)

RESPONSES = "/v1/infer/responses"
FAKES = Path(__file__).resolve().parents[1] / "fakes"
TOY_ID = "b3os/toy-reasoner"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
QUESTION = {"role": "user", "content": "What is the weather in Eugene, Oregon? Use the tool."}
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def ask(**body: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "temperature": 0, "max_output_tokens": 16, **body}


def assert_error(response: Any, status: int, code: str, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (code, param, "invalid_request_error"), error
    return error


# --- reading a stream ------------------------------------------------------------------------------


def parse_events(text: str) -> list[dict[str, Any]]:
    """The SSE blocks of a Responses stream; each one's ``event:`` line must name its ``type``."""
    events = []
    for block in filter(None, text.split("\n\n")):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(lines) == {"event", "data"}, block
        event = json.loads(lines["data"])
        assert lines["event"] == event["type"]
        events.append(event)
    return events


EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.failed": "ResponseFailedEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.reasoning_text.delta": "ResponseReasoningTextDeltaEvent",
    "response.reasoning_text.done": "ResponseReasoningTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "error": "ResponseErrorEvent",
}


def validate_event(spec: OpenAISpec, event: dict[str, Any]) -> None:
    # The event's own schema first: a failure of the whole union would not say what is wrong.
    spec.validate(EVENT_SCHEMAS[event["type"]], event)
    spec.validate("ResponseStreamEvent", event)


def check_stream(spec: OpenAISpec, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Every invariant a client may rely on; returns the final Response."""
    for event in events:
        validate_event(spec, event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in TERMINAL
    assert sum(e["type"] in TERMINAL for e in events) == 1
    response = events[-1]["response"]
    assert {e["response"]["id"] for e in events if "response" in e} == {response["id"]}

    added = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.added"}
    done = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert sorted(added) == sorted(done) == list(range(len(done)))
    assert [done[i] for i in range(len(done))] == response["output"]
    for index, item in done.items():
        assert added[index]["id"] == item["id"] and added[index]["status"] == "in_progress"
        mine = [e for e in events if e.get("output_index") == index]
        assert {e.get("item_id", e.get("item", {}).get("id")) for e in mine} == {item["id"]}
        assert mine[0]["type"] == "response.output_item.added" and mine[-1]["type"] == "response.output_item.done"
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        if item["type"] == "function_call":
            (args_done,) = [e for e in mine if e["type"] == "response.function_call_arguments.done"]
            assert deltas == args_done["arguments"] == item["arguments"]
        else:
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            (text_done,) = [e for e in mine if e["type"] == f"response.{kind}.done"]
            (part_done,) = [e for e in mine if e["type"] == "response.content_part.done"]
            assert deltas == text_done["text"] == part_done["part"]["text"] == item["content"][0]["text"]
    return response


async def stream(api: API, body: dict[str, Any], spec: OpenAISpec) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    response = await api.post(RESPONSES, {**body, "stream": True})
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/event-stream")
    events = parse_events(await read_stream(response))
    return events, check_stream(spec, events)


def output_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


# --- a reasoning model on the TensorRT-LLM stand-in ------------------------------------------------


class EchoTokenizer:
    """What the renderer uses of a transformers tokenizer: a chat template and ``encode``."""

    chat_template = "{% for message in messages %}{{ message.content }}\n{% endfor %}"

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], *, chat_template: str | None = None, **_: Any
    ) -> str:
        return jinja2.Template(chat_template or self.chat_template).render(messages=conversation)

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        return list(range(len(text.split())))


def _drop_tensorrt_llm_modules() -> None:
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture
def toy_model(catalog_model: CatalogEntry, monkeypatch: pytest.MonkeyPatch) -> Iterator[CatalogEntry]:
    _drop_tensorrt_llm_modules()
    monkeypatch.syspath_prepend(str(FAKES))
    # The runner compiles guides with xgrammar, which imports the real transformers: load it before
    # the stand-in below takes that module's name.
    importlib.import_module("xgrammar")
    transformers = types.ModuleType("transformers")
    transformers.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: EchoTokenizer())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", transformers)
    monkeypatch.setattr(execution, "_runners", {})
    monkeypatch.setattr(execution, "_renderers", {})
    yield CatalogEntry.objects.create(
        public_id=TOY_ID,
        runner="tensorrt_llm",
        runner_settings={"model": "/models/toy-reasoner"},
        context_length=4096,
        max_output_tokens=256,
        reasoning=True,
    )
    tensorrt_llm_runner.shutdown_all()
    _drop_tensorrt_llm_modules()


@pytest.fixture(autouse=True)
def _usage_written() -> Iterator[None]:
    """Usage records are written off the request path: let them land before the test database is flushed."""
    yield
    flush()


# --- answers ------------------------------------------------------------------------------------


async def test_it_answers_a_string_input_with_a_complete_response(api: API, openai_spec: OpenAISpec) -> None:
    body = ask(
        instructions="You are a concise assistant.",
        input="Name one river in Oregon.",
        max_output_tokens=48,
        metadata={"ticket": "42"},
        user="user-1",
        store=True,
    )
    response = await api.post(RESPONSES, body)

    assert response.status_code == 200, response.content
    result = response.json()
    openai_spec.validate("Response", result)
    assert result["id"].startswith("resp_") and result["object"] == "response"
    assert result["status"] in ("completed", "incomplete")
    assert result["model"] == MODEL_ID and result["instructions"] == "You are a concise assistant."
    (message,) = result["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    assert output_text(result)
    usage = result["usage"]
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= 48
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert result["store"] is False and result["metadata"] == {"ticket": "42"}
    assert (result["user"], result["temperature"]) == ("user-1", 0)
    assert (result["tools"], result["tool_choice"], result["truncation"]) == ([], "auto", "disabled")


async def test_it_records_usage_for_the_responses_endpoint(api: API) -> None:
    result = (await api.post(RESPONSES, ask(input="Say hello."))).json()

    flush()
    record = await UsageRecord.objects.aget(request_id__isnull=False)
    assert (record.endpoint, record.model, record.status, record.error_code) == ("responses", MODEL_ID, 200, "")
    usage = result["usage"]
    assert (record.input_tokens, record.output_tokens) == (usage["input_tokens"], usage["output_tokens"])


async def test_it_streams_the_events_in_the_order_openai_sends_them(api: API, openai_spec: OpenAISpec) -> None:
    events, response = await stream(api, ask(input="Name one river in Oregon.", max_output_tokens=24), openai_spec)

    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if response["status"] == "completed" else "response.incomplete",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert response["usage"]["output_tokens"] > 0


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
async def test_it_ends_incomplete_at_max_output_tokens(api: API, openai_spec: OpenAISpec, streamed: bool) -> None:
    body = ask(input="Write a long story about a dragon who learns to sail.", max_output_tokens=16)
    if streamed:
        events, result = await stream(api, body, openai_spec)
        assert events[-1]["type"] == "response.incomplete"
    else:
        result = (await api.post(RESPONSES, body)).json()
        openai_spec.validate("Response", result)

    assert result["status"] == "incomplete"
    assert result["incomplete_details"] == {"reason": "max_output_tokens"}
    assert result["output"][-1]["status"] == "incomplete"
    assert result["usage"]["output_tokens"] == 16


async def test_it_returns_logprobs_when_included(api: API, openai_spec: OpenAISpec) -> None:
    body = ask(input="Say hello.", include=["message.output_text.logprobs"], top_logprobs=2)
    result = (await api.post(RESPONSES, body)).json()

    openai_spec.validate("Response", result)
    part = result["output"][0]["content"][0]
    assert part["logprobs"] and all(len(lp["top_logprobs"]) == 2 for lp in part["logprobs"])
    assert "".join(lp["token"] for lp in part["logprobs"]).strip() == part["text"].strip()


async def test_the_logprob_bytes_of_a_character_split_over_tokens_add_up_to_it(
    api: API, openai_spec: OpenAISpec
) -> None:
    body = ask(input="Répète: 日本語のテキスト 🐉🔥 ÅÄÖ", include=["message.output_text.logprobs"])
    result = (await api.post(RESPONSES, body)).json()

    openai_spec.validate("Response", result)
    part = result["output"][0]["content"][0]
    assert "🐉" in part["text"]
    # Where the budget ends inside a character (the last token holds its first bytes), the text ends before it.
    written, text = bytes(b for lp in part["logprobs"] for b in lp["bytes"]), part["text"].encode()
    assert written.startswith(text) and "\N{REPLACEMENT CHARACTER}" not in part["text"]
    assert codecs.getincrementaldecoder("utf-8")().decode(written[len(text) :]) == ""  # nothing, or a piece
    assert part["logprobs"][0]["token"] == "bytes:\\xf0\\x9f"  # a piece of a character, named as OpenAI does


async def test_the_tokens_of_a_character_the_budget_cut_keep_their_logprobs(api: API, openai_spec: OpenAISpec) -> None:
    # The greedy answer's 17th token holds the first bytes of a character the 18th would finish.
    include = ["message.output_text.logprobs"]
    body = ask(input="Reply with only emoji: 🎉🚀🍕😀👍", max_output_tokens=17, include=include)
    result = (await api.post(RESPONSES, body)).json()
    events, streamed = await stream(api, body, openai_spec)

    part = result["output"][0]["content"][0]
    written, text = bytes(b for lp in part["logprobs"] for b in lp["bytes"]), part["text"].encode()
    assert len(part["logprobs"]) == result["usage"]["output_tokens"] == 17
    assert written.startswith(text) and len(written) > len(text)  # the cut character's first bytes, and no text
    deltas = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert [lp["token"] for lp in deltas] == [lp["token"] for lp in part["logprobs"]]
    assert streamed["output"][0]["content"][0] == part


# --- the conversation, replayed --------------------------------------------------------------------


async def test_it_accepts_a_replayed_conversation_with_the_ids_and_statuses_clients_echo(
    api: API, openai_spec: OpenAISpec
) -> None:
    history = [
        {"role": "developer", "content": "Answer in one sentence."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION["content"]}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Use the tool."}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_weather_1",
            "name": "get_weather",
            "arguments": '{"city": "Eugene"}',
            "status": "completed",
        },
        {
            "type": "function_call_output",
            "call_id": "call_weather_1",
            "output": "52F and raining",
            "status": "completed",
        },
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "phase": "final_answer",
            "content": [{"type": "output_text", "text": "It is 52F and raining.", "annotations": [], "logprobs": []}],
        },
        {"role": "user", "content": "Should I take an umbrella?"},
    ]
    response = await api.post(RESPONSES, ask(input=history, tools=[WEATHER], tool_choice="none"))

    assert response.status_code == 200, response.content
    openai_spec.validate("Response", response.json())


def test_it_folds_input_items_into_the_chat_templates_messages() -> None:
    params = ResponseCreateRequest.model_validate(
        {
            "model": MODEL_ID,
            "instructions": "Be brief.",
            "input": [
                QUESTION,
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Eugene"}'},
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Bend"}'},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "52F"}]},
                {"type": "function_call_output", "call_id": "c2", "output": "40F"},
            ],
        }
    )

    assert responses.conversation(responses.input_items(params), instructions=params.instructions) == [
        {"role": "system", "content": "Be brief."},
        QUESTION,
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Call it.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Eugene"}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bend"}'}},
            ],
        },
        {"role": "tool", "content": "52F", "tool_call_id": "c1"},
        {"role": "tool", "content": "40F", "tool_call_id": "c2"},
    ]


def test_reasoning_goes_with_the_answer_of_its_own_turn_only() -> None:
    def thought(text: str) -> dict[str, Any]:
        return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}

    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}
    params = ResponseCreateRequest.model_validate(
        {
            "model": MODEL_ID,
            "input": [
                {"role": "user", "content": "First?"},
                thought("Cut off while thinking about the first"),  # a response the budget ended mid-thought
                {"role": "user", "content": "Second?"},
                thought("One thought."),
                thought("Another."),
                answer,
            ],
        }
    )

    folded = responses.conversation(responses.input_items(params), instructions=None)

    assert folded[-1] == {"role": "assistant", "content": "Done.", "reasoning_content": "One thought.\n\nAnother."}


async def test_it_refuses_an_orphan_function_call_output(api: API) -> None:
    body = {
        "model": MODEL_ID,
        "input": [QUESTION, {"type": "function_call_output", "call_id": "call_weather_1", "output": "52F and raining"}],
    }
    response = await api.post(RESPONSES, body)

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "code": "invalid_request",
            "message": 'no function_call with call_id "call_weather_1" comes before this output',
            "param": "input.1.call_id",
            "type": "invalid_request_error",
        }
    }


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Eugene"}'}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "52F"}


@pytest.mark.parametrize(
    ("items", "param", "message"),
    [
        ([QUESTION, CALL], "input.1.call_id", 'no function_call_output with call_id "call_1" comes after this call'),
        (
            [QUESTION, CALL, OUTPUT, OUTPUT],
            "input.3.call_id",
            'the function_call with call_id "call_1" already has its output at input.2',
        ),
        (
            [QUESTION, CALL, CALL, OUTPUT],
            "input.2.call_id",
            'call_id "call_1" is already used by the function_call at input.1',
        ),
    ],
    ids=["call-without-output", "second-output", "reused-call-id"],
)
async def test_it_refuses_input_items_that_do_not_fit_together(api: API, items: list, param: str, message: str) -> None:
    error = assert_error(await api.post(RESPONSES, ask(input=items)), 400, "invalid_request", param)
    assert error["message"] == message


async def test_it_refuses_an_item_given_twice_as_openai_does(api: API) -> None:
    answer = {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]}
    response = await api.post(RESPONSES, ask(input=[QUESTION, answer, answer, {"role": "user", "content": "And?"}]))

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "code": "invalid_request",
            "message": "Duplicate item found with id msg_1. Remove duplicate items from your input and try again.",
            "param": "input",
            "type": "invalid_request_error",
        }
    }


@pytest.mark.parametrize(
    "arguments",
    ["{city", '{"city": "\\ud800"}', "[" * 1000 + "]" * 1000],
    ids=["not-json", "a-lone-surrogate-escaped", "nested-past-the-parser"],
)
async def test_it_takes_back_a_call_whose_arguments_do_not_parse_with_the_error_its_client_answered(
    api: API, openai_spec: OpenAISpec, arguments: str
) -> None:
    answer = {**OUTPUT, "output": "Error: the arguments are not valid JSON."}

    response = await api.post(RESPONSES, ask(input=[QUESTION, {**CALL, "arguments": arguments}, answer]))

    assert response.status_code == 200, response.content
    openai_spec.validate("Response", response.json())


async def test_it_refuses_input_with_nothing_to_respond_to(api: API) -> None:
    body = ask(input=[{"role": "system", "content": "Be brief."}])
    assert_error(await api.post(RESPONSES, body), 400, "invalid_value", "input")


@pytest.mark.parametrize(
    ("item", "param", "code"),
    [
        (
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "nope"}]},
            "input.0.content.1.type",
            "invalid_value",
        ),
        ({"role": "wizard", "content": "hi"}, "input.0.role", "invalid_value"),
        ({"role": "user"}, "input.0.content", "missing_required_parameter"),
        ({"content": "hi"}, "input.0.type", "missing_required_parameter"),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "input.0.arguments", "missing_required_parameter"),
        ({"type": "function_call_output", "call_id": "", "output": "x"}, "input.0.call_id", "invalid_value"),
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]},
            "input.0.content.0",
            "unsupported_content",
        ),
        (
            {"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]},
            "input.0.content.0",
            "unsupported_content",
        ),
        ({"type": ["function_call"], "call_id": "c"}, "input.0.type", "invalid_type"),
    ],
    ids=[
        "unknown-part",
        "unknown-role",
        "no-content",
        "no-type-or-role",
        "call-without-arguments",
        "empty-call-id",
        "image",
        "file",
        "type-not-a-string",
    ],
)
async def test_it_names_a_malformed_item_precisely(api: API, item: dict, param: str, code: str) -> None:
    assert_error(await api.post(RESPONSES, ask(input=[item])), 400, code, param)


@pytest.mark.parametrize(
    ("role", "part", "supported"),
    [
        (
            "user",
            {"type": "output_text", "text": "What is 2+2?", "annotations": []},
            "'input_text', 'input_image', and 'input_file'",
        ),
        ("user", {"type": "refusal", "refusal": "No."}, "'input_text', 'input_image', and 'input_file'"),
        ("system", {"type": "output_text", "text": "Be brief."}, "'input_text', 'input_image', and 'input_file'"),
        ("developer", {"type": "refusal", "refusal": "No."}, "'input_text', 'input_image', and 'input_file'"),
        ("assistant", {"type": "input_text", "text": "Four."}, "'output_text' and 'refusal'"),
    ],
)
async def test_a_message_holds_only_the_parts_of_its_role_as_at_openai(
    api: API, role: str, part: dict, supported: str
) -> None:
    # What the model wrote is an assistant's; what a user, system or developer sends is input. The user's output_text
    # was read as the user's turn, where chat completions refuses a user's refusal part.
    conversation = [{"type": "message", "role": role, "content": [part]}, {"role": "user", "content": "Go on."}]

    response = await api.post(RESPONSES, ask(input=conversation))

    assert_error(response, 400, "invalid_value", "input.0.content.0.type")
    assert f"Invalid value: '{part['type']}'. Supported values are: {supported}." in response.json()["error"]["message"]


async def test_an_assistant_message_of_output_text_and_refusal_parts_is_served(api: API) -> None:
    parts = [{"type": "output_text", "text": "Four.", "annotations": []}, {"type": "refusal", "refusal": "No more."}]
    conversation = [QUESTION, {"type": "message", "role": "assistant", "content": parts}, QUESTION]

    response = await api.post(RESPONSES, ask(input=conversation))

    assert response.status_code == 200, response.content


CHAT_FUNCTION = {"type": "function", "function": {"name": "get_weather"}}
CHAT_FORMAT = {"type": "json_schema", "json_schema": {"name": "river", "schema": {"type": "object"}}}
CHAT_PART = {"type": "input_text", "input_text": "hi"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [CHAT_FUNCTION]}, "tools.0.name"),
        ({"tools": [WEATHER], "tool_choice": CHAT_FUNCTION}, "tool_choice.name"),
        ({"text": {"format": CHAT_FORMAT}}, "text.format.name"),
        ({"input": [{"role": "user", "content": [CHAT_PART]}]}, "input.0.content.0.text"),
    ],
    ids=["tool", "tool_choice", "text.format", "content-part"],
)
async def test_it_names_the_missing_field_of_an_object_whose_type_is_also_one_of_its_keys(
    api: API, body: dict, param: str
) -> None:
    # Chat Completions' shapes ({"type": "function", "function": {...}}) sent to Responses: the field that is missing
    # is the object's own, not one inside the key that shares the type's name.
    response = await api.post(RESPONSES, ask(**{"input": "hi", **body}))

    error = assert_error(response, 400, "missing_required_parameter", param)
    assert error["message"] == f"Missing required parameter: '{param}'."


# --- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("previous_response_id", "resp_123"),
        ("conversation", "conv_123"),
        ("prompt", {"id": "pmpt_123"}),
        ("background", True),
        ("context_management", [{"type": "compaction"}]),
    ],
)
async def test_it_refuses_what_needs_stored_state_by_name(api: API, field: str, value: Any) -> None:
    assert_error(await api.post(RESPONSES, ask(input="hi", **{field: value})), 400, "unsupported_parameter", field)


@pytest.mark.parametrize(
    ("method", "path"),
    [("get", "resp_1"), ("delete", "resp_1"), ("post", "resp_1/cancel"), ("get", "resp_1/input_items")],
    ids=["retrieve", "delete", "cancel", "input-items"],
)
async def test_a_response_by_id_is_not_found_and_the_answer_says_this_node_keeps_none(
    api: API, method: str, path: str
) -> None:
    response = await getattr(api.client, method)(f"{RESPONSES}/{path}", headers=api._headers(None))

    error = assert_error(response, 404, "not_found", None)
    assert "stores no responses" in error["message"] and "send it whole as input" in error["message"]


async def test_compacting_is_not_found_and_the_answer_says_what_to_do_instead(api: API) -> None:
    response = await api.post(f"{RESPONSES}/compact", ask(input="hi"))

    error = assert_error(response, 404, "not_found", None)
    assert "does not compact" in error["message"] and 'truncation: "auto"' in error["message"]


async def test_the_input_tokens_of_a_request_are_counted_without_running_it(api: API, openai_spec: OpenAISpec) -> None:
    counted = await api.post(f"{RESPONSES}/input_tokens", {"model": MODEL_ID, "input": "Name one river in Oregon."})

    assert counted.status_code == 200
    openai_spec.validate("TokenCountsResource", counted.json())
    assert counted.json()["input_tokens"] > 5
    flush()
    assert not await UsageRecord.objects.aexists()  # nothing ran, nothing to meter


async def test_an_input_longer_than_the_context_is_counted_though_no_response_could_take_it(
    api: API, openai_spec: OpenAISpec
) -> None:
    context = (await CatalogEntry.objects.aget(public_id=MODEL_ID)).context_length
    body = {"model": MODEL_ID, "input": "word " * (context + 100)}

    counted = await api.post(f"{RESPONSES}/input_tokens", body)
    refused = await api.post(RESPONSES, body)

    assert counted.status_code == 200, counted.content
    openai_spec.validate("TokenCountsResource", counted.json())
    assert counted.json()["input_tokens"] > context
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert str(counted.json()["input_tokens"]) in refused.json()["error"]["message"]


async def test_instructions_and_tools_are_counted_without_input(api: API, openai_spec: OpenAISpec) -> None:
    # TokenCountsBody requires nothing: what the instructions, and the tools beside them, take alone.
    alone = await api.post(f"{RESPONSES}/input_tokens", {"model": MODEL_ID, "instructions": "Be brief."})
    with_tools = await api.post(
        f"{RESPONSES}/input_tokens", {"model": MODEL_ID, "instructions": "Be brief.", "tools": [WEATHER]}
    )

    assert (alone.status_code, with_tools.status_code) == (200, 200), (alone.content, with_tools.content)
    openai_spec.validate("TokenCountsResource", alone.json())
    assert 0 < alone.json()["input_tokens"] < with_tools.json()["input_tokens"]


@pytest.mark.parametrize(
    "input_",
    [[], [{"role": "system", "content": "Be brief."}], [{"role": "developer", "content": "Be brief."}]],
    ids=["none", "a-system-message", "a-developer-message"],
)
async def test_a_response_still_needs_a_message_to_respond_to(api: API, input_: list[dict[str, str]]) -> None:
    error = assert_error(
        await api.post(RESPONSES, {"model": MODEL_ID, "input": input_, "instructions": "Be brief."}),
        400,
        "invalid_value",
        "input",
    )
    assert "no message for the model to respond to" in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", True),
        ("max_output_tokens", 999999),
        ("route", "gateway"),
        # Values the parameter could never take: still refused as a parameter the count does not have.
        ("stream", 1),
        ("max_output_tokens", 5),
        ("route", 1),
        ("metadata", {"a": 1}),
    ],
)
async def test_counting_input_tokens_takes_only_what_shapes_the_input(api: API, field: str, value: Any) -> None:
    body = {"model": MODEL_ID, "input": "Name one river in Oregon.", field: value}

    response = await api.post(f"{RESPONSES}/input_tokens", body)

    error = assert_error(response, 400, "unknown_parameter", field)
    assert error["message"] == f"Unrecognized request argument supplied: {field}"


async def test_counting_input_tokens_refuses_a_style_preset_by_name_as_the_model_has_none(api: API) -> None:
    body = {"model": MODEL_ID, "input": "Name one river in Oregon.", "personality": "friendly"}

    error = assert_error(await api.post(f"{RESPONSES}/input_tokens", body), 400, "unsupported_parameter", "personality")

    assert "no style presets" in error["message"]


@pytest.mark.parametrize("field", ["conversation", "prompt", "context_management", "moderation"])
@pytest.mark.parametrize("value", [0, False, 0.0, ""])
async def test_a_falsy_value_of_the_wrong_type_for_a_refused_field_is_refused_too(
    api: API, field: str, value: Any
) -> None:
    response = await api.post(RESPONSES, ask(input="hi", **{field: value}))

    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == field
    assert response.json()["error"]["code"] == "invalid_type" or field == "conversation" and value == ""


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "web_search"},
        {"type": "web_search_preview"},
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "code_interpreter", "container": {"type": "auto"}},
        {"type": "mcp", "server_label": "deepwiki", "server_url": "https://mcp.deepwiki.com/mcp"},
        {"type": "image_generation"},
    ],
    ids=lambda tool: tool["type"],
)
async def test_it_refuses_tools_that_openai_runs_on_its_side(api: API, tool: dict) -> None:
    error = assert_error(
        await api.post(RESPONSES, ask(input="hi", tools=[WEATHER, tool])), 400, "unsupported_parameter", "tools.1.type"
    )
    assert tool["type"] in error["message"] and "OpenAI's side" in error["message"]


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "computer_use_preview", "display_width": 1024, "display_height": 768, "environment": "linux"},
        {"type": "local_shell"},
        {"type": "shell"},
        {"type": "apply_patch"},
    ],
    ids=lambda tool: tool["type"],
)
async def test_it_refuses_built_in_tools_the_client_runs_saying_their_calls_are_not_written_here(
    api: API, tool: dict
) -> None:
    error = assert_error(
        await api.post(RESPONSES, ask(input="hi", tools=[WEATHER, tool])), 400, "unsupported_parameter", "tools.1.type"
    )
    assert (
        tool["type"] in error["message"]
        and "items of its own, which this node's models do not write" in (error["message"])
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "functions", "name": "get_weather"}]}, "tools.0.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_serch"}}, "tool_choice.type"),
    ],
    ids=["a tool", "a tool choice"],
)
async def test_a_misspelt_tool_type_is_an_invalid_value_not_a_tool_the_node_lacks(
    api: API, fields: dict[str, Any], param: str
) -> None:
    error = assert_error(await api.post(RESPONSES, ask(input="hi", **fields)), 400, "invalid_value", param)

    assert "Supported values are: 'function'" in error["message"]


def test_every_tool_and_item_type_in_openais_spec_is_one_the_node_refuses_as_unsupported_not_as_unknown(
    openai_spec: OpenAISpec,
) -> None:
    schemas = openai_spec.document["components"]["schemas"]

    def types(name: str) -> set[str]:
        """The ``type`` values of the members of a union schema, through nested unions."""
        found: set[str] = set()
        for member in schemas[name].get("oneOf", []) + schemas[name].get("anyOf", []):
            if "$ref" not in member:
                continue
            referenced = member["$ref"].rsplit("/", 1)[-1]
            kind = schemas[referenced].get("properties", {}).get("type")
            if kind is None:
                found |= types(referenced)
            else:
                found |= set(kind.get("enum", [])) | ({kind["const"]} if "const" in kind else set())
        return found

    assert types("Tool") | types("ToolChoiceParam") <= OPENAI_TOOL_TYPES
    assert types("InputItem") <= OPENAI_ITEM_TYPES


async def test_an_input_item_of_a_type_openai_does_not_know_is_an_invalid_value(api: API) -> None:
    error = assert_error(
        await api.post(RESPONSES, ask(input=[{"type": "mesage", "role": "user"}, QUESTION])),
        400,
        "invalid_value",
        "input.0.type",
    )
    assert "'mesage'" in error["message"] and "'message'" in error["message"]


@pytest.mark.parametrize("kind", ["item_reference", "web_search_call", "computer_call_output", "mcp_call"])
async def test_it_refuses_input_items_it_cannot_replay(api: API, kind: str) -> None:
    items = [QUESTION, {"type": kind, "id": "x_1"}]
    assert_error(await api.post(RESPONSES, ask(input=items)), 400, "unsupported_parameter", "input.1.type")


@pytest.mark.parametrize("reference", [{"id": "msg_1"}, {"type": None, "id": "msg_1"}], ids=["no-type", "null-type"])
async def test_it_reads_an_item_of_only_an_id_as_the_item_reference_it_is_and_refuses_it(
    api: API, reference: dict
) -> None:
    # OpenAI's ItemReferenceParam: the id is required, the type may be left out or null.
    error = assert_error(
        await api.post(RESPONSES, ask(input=[QUESTION, reference])), 400, "unsupported_parameter", "input.1.id"
    )
    assert "item_reference" in error["message"]


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"reasoning": {"effort": "low"}}, "unsupported_parameter", "reasoning.effort"),
        ({"include": ["web_search_call.results"]}, "unsupported_parameter", "include.0"),
        ({"include": [INCLUDE_LOGPROBS, "message.output_text.logprob"]}, "invalid_value", "include.1"),
        ({"text": {"verbosity": "low"}}, "unsupported_parameter", "text.verbosity"),
        ({"service_tier": "flex"}, "unsupported_parameter", "service_tier"),
        ({"frobnicate": 1}, "unknown_parameter", "frobnicate"),
        ({"client_metadata": {"turn": 1}}, "invalid_type", "client_metadata.turn"),
        ({"max_output_tokens": 8}, "integer_below_min_value", "max_output_tokens"),
        ({"temperature": 3}, "decimal_above_max_value", "temperature"),
        ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
            "invalid_value",
            "tool_choice.name",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "missing_required_parameter", "tool_choice.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "unsupported_parameter", "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "invalid_value", "tools.1.name"),
        ({"tools": [{**WEATHER, "name": "get weather"}]}, "invalid_value", "tools.0.name"),
        ({"tools": [{**WEATHER, "colour": "red"}]}, "unknown_parameter", "tools.0.colour"),
        ({"tools": [{**WEATHER, "type": {"name": "function"}}]}, "invalid_type", "tools.0.type"),
        ({"stream_options": {"include_obfuscation": False}}, "invalid_value", "stream_options"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "missing_required_parameter", "text.format.name"),
        ({"tools": [{**WEATHER, "parameters": {"type": "place"}}]}, "invalid_value", "tools.0.parameters"),
        ({"tools": [{**WEATHER, "parameters": {"type": "string"}}]}, "invalid_value", "tools.0.parameters"),
        (
            {"tools": [{**WEATHER, "strict": True, "parameters": {"type": "string", "pattern": "^(?!x)$"}}]},
            "invalid_value",
            "tools.0.parameters",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "required": "a"}}}},
            "invalid_value",
            "text.format.schema",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {"type": "null"}}}}},
            "invalid_value",
            "text.format.schema",
        ),
    ],
)
async def test_it_refuses_bad_parameters_by_name(api: API, body: dict, code: str, param: str) -> None:
    assert_error(await api.post(RESPONSES, ask(input="hi", **body)), 400, code, param)


async def test_a_model_that_does_not_reason_names_the_efforts_it_takes_and_takes_them(api: API) -> None:
    error = assert_error(
        await api.post(RESPONSES, ask(input="hi", reasoning={"effort": "low"})),
        400,
        "unsupported_parameter",
        "reasoning.effort",
    )
    assert "an effort of none or minimal" in error["message"]

    response = await api.post(RESPONSES, ask(input="hi", reasoning={"effort": "minimal"}, max_output_tokens=16))

    assert response.status_code == 200, response.content


@pytest.mark.parametrize(
    "reasoning",
    [{"mode": "standard"}, {"context": "auto"}, {"effort": "none", "summary": "auto", "mode": None, "context": None}],
    ids=["standard-mode", "auto-context", "nulls"],
)
def test_openais_reasoning_mode_and_context_are_taken_at_what_this_node_does(
    catalog_model: CatalogEntry, reasoning: dict
) -> None:
    params = parse(ResponseCreateRequest, {"model": MODEL_ID, "input": "hi", "reasoning": reasoning})

    assert responses.to_generation_request(params, catalog_model).reasoning is False


@pytest.mark.parametrize(
    ("reasoning", "param"),
    [
        ({"mode": "pro"}, "reasoning.mode"),
        ({"effort": "none", "context": "all_turns"}, "reasoning.context"),
        ({"context": "current_turn"}, "reasoning.context"),
    ],
)
async def test_a_reasoning_mode_or_context_this_node_cannot_apply_is_refused_as_unsupported_not_unknown(
    api: API, reasoning: dict, param: str
) -> None:
    # OpenAI knows these parameters: "unrecognized" would tell the client its request is wrong, not this node.
    assert_error(await api.post(RESPONSES, ask(input="hi", reasoning=reasoning)), 400, "unsupported_parameter", param)


def test_a_function_the_model_may_call_directly_is_offered_whoever_else_may_call_it(
    catalog_model: CatalogEntry,
) -> None:
    tools = [
        {**WEATHER, "allowed_callers": ["direct"]},
        {**WEATHER, "name": "get_forecast", "allowed_callers": ["direct", "programmatic"]},
        {**WEATHER, "name": "get_tide", "allowed_callers": None},
    ]
    params = parse(ResponseCreateRequest, {"model": MODEL_ID, "input": "hi", "tools": tools})

    request = responses.to_generation_request(params, catalog_model)
    assert [tool.name for tool in request.tools] == ["get_weather", "get_forecast", "get_tide"]


async def test_a_function_only_code_may_call_is_refused_at_its_allowed_callers(api: API) -> None:
    scripted = {**WEATHER, "name": "get_forecast", "allowed_callers": ["programmatic"]}

    error = assert_error(
        await api.post(RESPONSES, ask(input="hi", tools=[WEATHER, scripted])),
        400,
        "unsupported_parameter",
        "tools.1.allowed_callers",
    )
    assert "programmatic" in error["message"]


@pytest.mark.parametrize(
    "image",
    [
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="},
        {"type": "input_image", "file_id": "file_1"},
    ],
    ids=["by-url", "by-file-id"],
)
async def test_a_model_the_node_serves_takes_no_image_even_flagged_for_images_around_the_admin(
    api: API, catalog_model: CatalogEntry, image: dict
) -> None:
    # Its runners read text only: the flag set from a shell is not what clients are told, nor what requests get.
    await CatalogEntry.objects.filter(pk=catalog_model.pk).aupdate(image_input=True)
    message = {"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, image]}

    error = assert_error(
        await api.post(RESPONSES, ask(input=[message])), 400, "unsupported_content", "input.0.content.1"
    )

    assert "does not accept image input" in error["message"]
    listed = (await api.get(f"/v1/infer/models/{MODEL_ID}")).json()
    assert listed["b3os"]["image_input"] is False


async def test_it_refuses_capabilities_the_model_lacks(api: API, catalog_model: CatalogEntry) -> None:
    await CatalogEntry.objects.filter(pk=catalog_model.pk).aupdate(json_schema=False, tools=False)
    json_format = {"format": {"type": "json_object"}}

    assert_error(
        await api.post(RESPONSES, ask(input="JSON?", text=json_format)), 400, "unsupported_parameter", "text.format"
    )
    assert_error(await api.post(RESPONSES, ask(input="hi", tools=[WEATHER])), 400, "unsupported_parameter", "tools")


@pytest.mark.parametrize(
    "settings",
    [
        {"reasoning": None, "include": []},
        {"reasoning": {}},
        {"reasoning": {"effort": "none", "summary": "auto"}},
        {"include": ["reasoning.encrypted_content"], "store": False},
    ],
    ids=["reasoning-null", "reasoning-empty", "effort-none", "encrypted-reasoning"],
)
def test_it_accepts_the_settings_sdks_send_on_any_model(catalog_model: CatalogEntry, settings: dict) -> None:
    params = ResponseCreateRequest.model_validate({"model": MODEL_ID, "input": "hi", **settings})

    assert responses.to_generation_request(params, catalog_model).reasoning is False


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "word " * 64}, "input", "Please reduce the length of the input."),
        (
            {"input": "hi", "max_output_tokens": 100},
            "max_output_tokens",
            "in the output). Please reduce the length of the input or output.",
        ),
    ],
)
async def test_it_refuses_what_does_not_fit_the_context_in_the_responses_apis_words(
    api: API, catalog_model: CatalogEntry, body: dict, param: str, words: str
) -> None:
    await CatalogEntry.objects.filter(pk=catalog_model.pk).aupdate(context_length=64)
    response = await api.post(RESPONSES, {"model": MODEL_ID, **body})

    error = assert_error(response, 400, "context_length_exceeded", param)
    assert words in error["message"] and "messages" not in error["message"]


def remembered_turns(count: int) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    for number in range(count):
        turns.append({"role": "user", "content": f"Remember the number {number} and the river Willamette."})
        turns.append({"role": "assistant", "content": f"I will remember {number}."})
    return turns


async def test_truncation_auto_leaves_out_the_oldest_turns_that_do_not_fit_and_no_more(
    api: API, catalog_model: CatalogEntry, openai_spec: OpenAISpec
) -> None:
    await CatalogEntry.objects.filter(pk=catalog_model.pk).aupdate(context_length=256)
    body = ask(
        instructions="Answer in one word.",
        input=[*remembered_turns(12), {"role": "user", "content": "Say hi."}],
        max_output_tokens=16,
    )
    assert_error(await api.post(RESPONSES, body), 400, "context_length_exceeded", "input")

    response = await api.post(RESPONSES, {**body, "truncation": "auto"})

    assert response.status_code == 200, response.content
    result = response.json()
    openai_spec.validate("Response", result)
    assert result["truncation"] == "auto" and result["status"] in ("completed", "incomplete")
    # The prompt fits with the output asked for, and less than one more turn of room is left unused.
    assert 256 - 16 - 40 < result["usage"]["input_tokens"] <= 256 - 16


async def test_truncation_auto_still_refuses_a_last_turn_that_alone_does_not_fit(
    api: API, catalog_model: CatalogEntry
) -> None:
    await CatalogEntry.objects.filter(pk=catalog_model.pk).aupdate(context_length=64)
    body = ask(input=[*remembered_turns(2), {"role": "user", "content": "river " * 80}], truncation="auto")

    assert_error(await api.post(RESPONSES, body), 400, "context_length_exceeded", "input")


async def test_a_get_is_a_405_that_allows_only_post(api: API) -> None:
    response = await api.get(RESPONSES)
    assert_error(response, 405, "method_not_allowed", None)
    assert response["Allow"] == "POST"


# --- function tools -------------------------------------------------------------------------------


def test_a_tools_strict_reaches_the_runtime_only_when_set(catalog_model: CatalogEntry) -> None:
    tools = [
        WEATHER,
        {**WEATHER, "name": "strict_weather", "strict": True},
        {**WEATHER, "name": "loose", "strict": False},
    ]
    params = ResponseCreateRequest.model_validate({"model": MODEL_ID, "input": "hi", "tools": tools})

    request = responses.to_generation_request(params, catalog_model)
    assert [tool.strict for tool in request.tools] == [None, True, False]
    assert [tool["strict"] for tool in responses.echo(params)["tools"]] == [None, True, False]


async def test_it_echoes_the_tools_and_tool_choice_as_applied(api: API, openai_spec: OpenAISpec) -> None:
    tools = [WEATHER, {**WEATHER, "name": "strict_weather", "strict": False}]
    result = (
        await api.post(RESPONSES, ask(input="Say hi.", tools=tools, tool_choice="none", parallel_tool_calls=False))
    ).json()

    openai_spec.validate("Response", result)
    assert result["tools"] == [{**WEATHER, "strict": None}, {**WEATHER, "name": "strict_weather", "strict": False}]
    assert (result["tool_choice"], result["parallel_tool_calls"]) == ("none", False)
    assert all(item["type"] == "message" for item in result["output"])


async def test_allowed_tools_limits_the_calls_to_its_subset_and_is_echoed(api: API, openai_spec: OpenAISpec) -> None:
    stock = {**WEATHER, "name": "get_stock_price", "description": "Latest price of a stock ticker."}
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}
    question = "What is the weather in Eugene, Oregon?"
    response = await api.post(
        RESPONSES, ask(input=question, tools=[stock, WEATHER], tool_choice=choice, max_output_tokens=60)
    )
    result = response.json()

    openai_spec.validate("Response", result)
    assert [(item["type"], item["name"]) for item in result["output"]] == [("function_call", "get_weather")]
    assert result["tool_choice"] == choice and len(result["tools"]) == 2


async def test_a_required_call_of_a_tool_whose_parameters_refer_to_their_definitions_is_made(
    api: API, openai_spec: OpenAISpec
) -> None:
    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    parameters = {
        "$defs": {"Address": address},
        "type": "object",
        "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Address"}},
        "required": ["name", "home"],
    }
    person = {"type": "function", "name": "Person", "strict": True, "parameters": parameters}
    question = "Record Ann, who lives in Eugene."
    response = await api.post(
        RESPONSES, ask(input=question, tools=[person, WEATHER], tool_choice="required", max_output_tokens=60)
    )
    result = response.json()

    assert response.status_code == 200, result
    openai_spec.validate("Response", result)
    assert [item["type"] for item in result["output"]] == ["function_call"]


@pytest.mark.parametrize(
    ("tools", "param", "code"),
    [
        ([{"type": "function", "name": "get_stock_price"}], "tool_choice.tools.0.name", "invalid_value"),
        ([{"type": "web_search"}], "tool_choice.tools.0.type", "unsupported_parameter"),
        ([], "tool_choice.tools", "invalid_value"),
    ],
)
async def test_allowed_tools_must_name_tools_of_the_request(api: API, tools: list, param: str, code: str) -> None:
    choice = {"type": "allowed_tools", "mode": "auto", "tools": tools}

    assert_error(await api.post(RESPONSES, ask(input="hi", tools=[WEATHER], tool_choice=choice)), 400, code, param)


async def test_a_forced_call_streams_its_arguments_and_its_output_goes_back(
    api: API, openai_spec: OpenAISpec, toy_model: CatalogEntry
) -> None:
    body = {
        "model": TOY_ID,
        "input": [QUESTION],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    events, first = await stream(api, body, openai_spec)

    assert "response.function_call_arguments.delta" in [e["type"] for e in events]
    (call,) = first["output"]
    assert call["type"] == "function_call" and call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert call["name"] == "get_weather" and "city" in json.loads(call["arguments"])
    assert first["tool_choice"] == {"type": "function", "name": "get_weather"}

    follow = [
        QUESTION,
        *first["output"],
        {"type": "function_call_output", "call_id": call["call_id"], "output": "52F and raining"},
    ]
    answer = (await api.post(RESPONSES, {"model": TOY_ID, "input": follow, "tools": [WEATHER]})).json()
    openai_spec.validate("Response", answer)
    assert "52F and raining" in output_text(answer)  # the echo engine repeats its prompt, which holds the output


@pytest.mark.parametrize(
    "text_format",
    [
        {
            "type": "json_schema",
            "name": "river",
            "schema": {
                "type": "object",
                "properties": {"river": {"type": "string", "minLength": 3}},
                "required": ["river"],
            },
            "strict": True,
        },
        {"type": "json_object"},
    ],
    ids=["json_schema", "json_object"],
)
async def test_text_format_makes_the_answer_json(
    api: API, openai_spec: OpenAISpec, toy_model: CatalogEntry, text_format: dict
) -> None:
    body = {"model": TOY_ID, "input": "Name one river in Oregon as JSON.", "text": {"format": text_format}}
    result = (await api.post(RESPONSES, body)).json()

    openai_spec.validate("Response", result)
    answer = json.loads(output_text(result))
    assert isinstance(answer, dict) and (text_format["type"] == "json_object" or len(answer["river"]) >= 3)
    assert result["text"]["format"] == text_format


async def test_json_object_is_refused_when_neither_instructions_nor_input_ask_for_json(api: API) -> None:
    body = ask(input=[{"role": "user", "content": "Name one river."}], text={"format": {"type": "json_object"}})
    error = assert_error(await api.post(RESPONSES, body), 400, "invalid_request", "input")
    assert "must contain the word 'json'" in error["message"]


async def test_json_object_takes_the_word_json_from_the_instructions(
    api: API, openai_spec: OpenAISpec, toy_model: CatalogEntry
) -> None:
    body = {
        "model": TOY_ID,
        "instructions": "You answer in JSON.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Name one river in Oregon."}]}],
        "text": {"format": {"type": "json_object"}},
    }
    result = (await api.post(RESPONSES, body)).json()

    openai_spec.validate("Response", result)
    assert isinstance(json.loads(output_text(result)), dict)


# --- reasoning ------------------------------------------------------------------------------------

THOUGHTFUL = "<think> The user wants one river. </think> The Willamette."


async def test_reasoning_comes_back_as_a_reasoning_item_with_its_own_events(
    api: API, openai_spec: OpenAISpec, toy_model: CatalogEntry
) -> None:
    events, result = await stream(
        api, {"model": TOY_ID, "input": THOUGHTFUL, "reasoning": {"effort": "medium"}}, openai_spec
    )

    reasoning, message = result["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"][0]["text"].strip() == "The user wants one river."
    assert output_text(result) == "The Willamette."
    assert {"response.reasoning_text.delta", "response.reasoning_text.done"} <= {e["type"] for e in events}
    assert result["reasoning"] == {"effort": "medium", "summary": None}
    assert 0 < result["usage"]["output_tokens_details"]["reasoning_tokens"] < result["usage"]["output_tokens"]

    again = await api.post(
        RESPONSES,
        {
            "model": TOY_ID,
            "input": [
                {"role": "user", "content": THOUGHTFUL},
                reasoning,
                message,
                {"role": "user", "content": "More?"},
            ],
        },
    )
    assert again.status_code == 200, again.content


def all_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every event of a job reaches the API in one batch, as on a machine too busy to read them one at a time."""
    batches = Generation._batches

    async def together(self: Generation) -> AsyncGenerator[list[Any], None]:
        yield [event async for batch in batches(self) for event in batch]

    monkeypatch.setattr(Generation, "_batches", together)


@pytest.mark.parametrize(("streamed", "arriving"), [(False, "apart"), (True, "apart"), (False, "together")])
async def test_the_answers_logprobs_are_those_of_its_own_text_not_of_the_reasoning_before_it(
    api: API,
    openai_spec: OpenAISpec,
    toy_model: CatalogEntry,
    monkeypatch: pytest.MonkeyPatch,
    streamed: bool,
    arriving: str,
) -> None:
    if arriving == "together":  # the reasoning's tokens and the answer's in one chunk
        all_at_once(monkeypatch)
    body = {
        "model": TOY_ID,
        "input": THOUGHTFUL,
        "reasoning": {"effort": "medium"},
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 1,
    }
    if streamed:
        _, result = await stream(api, body, openai_spec)
    else:
        result = (await api.post(RESPONSES, body)).json()
        openai_spec.validate("Response", result)

    (part,) = result["output"][-1]["content"]
    tokens = "".join(logprob["token"] for logprob in part["logprobs"])
    # The answer's first token carries the space after </think>, which the answer's text leaves out.
    assert tokens.lstrip() == part["text"] == "The Willamette."


async def test_reasoning_effort_none_turns_reasoning_off(api: API, toy_model: CatalogEntry) -> None:
    result = (await api.post(RESPONSES, {"model": TOY_ID, "input": THOUGHTFUL, "reasoning": {"effort": "none"}})).json()

    assert [item["type"] for item in result["output"]] == ["message"]
    assert result["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


# --- Codex ------------------------------------------------------------------------------------------
# A turn as Codex (0.171.0) sends it: instructions as a developer message, strict-false function tools,
# and on every turn client_metadata, prompt_cache_key, include, reasoning.summary, store and parallel_tool_calls.

EXEC_COMMAND = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string", "description": "Shell command to execute."}},
        "required": ["cmd"],
        "additionalProperties": False,
    },
}
CODEX_METADATA = {
    "session_id": "01a22bd8-aa4c-78b1-b5d6-d14d3cba7de5",
    "turn_id": "01a22bd8-aa60-7ff3-ae10-36adad339940",
    "x-codex-installation-id": "64ca6028-bf36-4851-aaf8-7db24fa5d640",
    "x-codex-turn-metadata": '{"request_kind":"turn","sandbox":"seccomp","turn_trigger":"exec"}',
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
MULTI_AGENT = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [{**EXEC_COMMAND, "name": "spawn_agent", "description": "Spawns a sub-agent."}],
}


def codex_turn(**changes: Any) -> dict[str, Any]:
    turn = {
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are a coding agent. Be brief."}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]},
        ],
        "tools": [EXEC_COMMAND],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a22bd8-aa4c-78b1-b5d6-d14d3cba7de5",
        "client_metadata": CODEX_METADATA,
    }
    return ask(**{**turn, **changes})


async def test_it_answers_a_turn_as_codex_sends_it(api: API, openai_spec: OpenAISpec) -> None:
    _, result = await stream(api, codex_turn(), openai_spec)

    assert result["status"] in ("completed", "incomplete") and result["usage"]["output_tokens"] > 0
    assert (result["store"], result["parallel_tool_calls"], result["tools"][0]["strict"]) == (False, True, False)
    assert result["reasoning"]["summary"] == "auto"
    assert "client_metadata" not in result


def test_it_accepts_client_metadata_and_ignores_it(catalog_model: CatalogEntry) -> None:
    with_metadata = parse(ResponseCreateRequest, codex_turn())
    without = parse(ResponseCreateRequest, {k: v for k, v in codex_turn().items() if k != "client_metadata"})

    assert responses.to_generation_request(with_metadata, catalog_model) == responses.to_generation_request(
        without, catalog_model
    )
    assert responses.echo(with_metadata) == responses.echo(without)


def test_it_accepts_codexs_prompt_cache_key_and_echoes_it(catalog_model: CatalogEntry) -> None:
    params = parse(ResponseCreateRequest, codex_turn(prompt_cache_key="thread-42"))

    responses.to_generation_request(params, catalog_model)
    assert responses.echo(params)["prompt_cache_key"] == "thread-42"


def test_it_accepts_codexs_include_of_encrypted_reasoning(catalog_model: CatalogEntry) -> None:
    # Reasoning, when a model has it, comes back readable: there is nothing to encrypt, and nothing lost statelessly.
    params = parse(ResponseCreateRequest, codex_turn(include=["reasoning.encrypted_content"]))

    request = responses.to_generation_request(params, catalog_model)
    assert (request.reasoning, request.logprobs) == (False, False)


async def test_it_refuses_codexs_web_search_tool_by_its_place_in_tools(api: API) -> None:
    error = assert_error(
        await api.post(RESPONSES, codex_turn(tools=[EXEC_COMMAND, WEB_SEARCH])),
        400,
        "unsupported_parameter",
        "tools.1.type",
    )
    assert "web_search" in error["message"] and "OpenAI's side" in error["message"]


async def test_it_refuses_a_namespace_tool_by_its_place_in_tools_naming_the_namespace(api: API) -> None:
    error = assert_error(
        await api.post(RESPONSES, codex_turn(tools=[EXEC_COMMAND, MULTI_AGENT, WEB_SEARCH])),
        400,
        "unsupported_parameter",
        "tools.1.type",
    )
    assert "namespace" in error["message"] and '"multi_agent_v1"' in error["message"]


# --- failures -------------------------------------------------------------------------------------


async def test_a_failure_mid_stream_ends_with_response_failed_and_is_recorded(
    api: API, openai_spec: OpenAISpec, toy_model: CatalogEntry
) -> None:
    # The engine refuses prompts longer than max_num_tokens, once the stream has begun.
    await CatalogEntry.objects.filter(pk=toy_model.pk).aupdate(
        runner_settings={"model": "/models/toy-reasoner", "max_num_tokens": 4}
    )

    events, result = await stream(api, {"model": TOY_ID, "input": "Name one river in Oregon, please."}, openai_spec)

    error, failed = events[-2:]
    assert failed["type"] == "response.failed" and result["status"] == "failed"
    # What failed, by the API's code, then the Response's error: a prompt the engine cannot take fails the same way
    # when sent again, so the client is not told to retry (server_error) but that the prompt is at fault.
    assert (error["type"], error["code"]) == ("error", "context_length_exceeded")
    assert result["error"] == {"code": "invalid_prompt", "message": error["message"]}
    flush()
    record = await UsageRecord.objects.aget(model=TOY_ID)
    assert record.endpoint == "responses" and record.error_code == "context_length_exceeded"
    # The failed response counts what its record counts: nothing, as it failed before its first token.
    usage = result["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (record.input_tokens, record.output_tokens) == (0, 0)


@pytest.mark.parametrize(
    ("code", "failed_as"),
    [
        ("constraint_too_costly", "invalid_prompt"),
        ("context_length_exceeded", "invalid_prompt"),
        ("invalid_api_key", "invalid_prompt"),  # its key revoked or expired mid-stream: trying again cannot help
        ("worker_lost", "server_error"),
    ],
)
def test_a_failure_the_request_itself_caused_fails_the_response_as_invalid_prompt_not_server_error(
    openai_spec: OpenAISpec, code: str, failed_as: str
) -> None:
    # server_error tells a client to send the same request again; invalid_prompt that it would fail the same way.
    encoder = responses.ResponseEncoder(
        echo=responses.echo(parse(ResponseCreateRequest, {"model": MODEL_ID, "input": "Hi"}))
    )

    *_, error, failed = encoder.fail("Generation failed.", error_code=code)

    openai_spec.validate("ResponseFailedEvent", failed)
    assert error["code"] == code and failed["response"]["error"]["code"] == failed_as
