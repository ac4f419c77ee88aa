"""Requests built to hurt the node: each is refused by name, costs little, and leaves the server answering."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inference.engine import execution, generation
from inference.engine.runners.base import PromptRenderer
from inference.models import CatalogEntry, UsageRecord
from inference.usage import metrics
from inference.usage import records as usage
from orgs import admission
from orgs.models import Limit, Organization
from tests.conftest import API, MODEL_ID, LiveServer

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/infer/chat/completions"
RESPONSES = "/v1/infer/responses"
QUESTION = [{"role": "user", "content": "Hi"}]


def chat(**overrides: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": QUESTION, "max_tokens": 2, "temperature": 0, **overrides}


def output_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def strict_tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "strict": True, "parameters": parameters}}


LONG_STRING = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 20000}}, "required": ["a"]}


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def assert_refused(response: Any, param: str | None, says: str, *, status: int = 400) -> None:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert says in error["message"]


# --- schemas: bounded before anything runs -------------------------------------------------------------


def test_a_schema_whose_grammar_would_crash_the_parser_is_a_400_and_the_server_answers_after(
    node_server: LiveServer,
) -> None:
    headers = {"Authorization": f"Bearer {node_server.key}"}
    refused = httpx.post(
        f"{node_server.base_url}/chat/completions",
        json=chat(response_format=output_schema(LONG_STRING)),
        headers=headers,
        timeout=60,
    )
    after = httpx.post(f"{node_server.base_url}/chat/completions", json=chat(), headers=headers, timeout=120)

    assert_refused(refused, "response_format.json_schema.schema", "maxLength 20000 is more than the 1000")
    assert after.status_code == 200
    assert node_server.process.poll() is None


async def test_a_strict_tool_past_the_bounds_is_named_by_its_place(api: API) -> None:
    tools = [strict_tool("fine", {"type": "object"}), strict_tool("huge", LONG_STRING)]

    assert_refused(await api.post(CHAT, chat(tools=tools)), "tools.1.function.parameters", "maxLength 20000")


async def test_a_forced_tool_past_the_bounds_is_named_by_its_place(api: API) -> None:
    tool = {"type": "function", "function": {"name": "huge", "parameters": LONG_STRING}}
    forced = {"type": "function", "function": {"name": "huge"}}

    response = await api.post(CHAT, chat(tools=[tool], tool_choice=forced))

    assert_refused(response, "tools.0.function.parameters", "maxLength 20000")


async def test_a_responses_text_format_past_the_bounds_is_named(api: API) -> None:
    text = {"format": {"type": "json_schema", "name": "answer", "schema": LONG_STRING}}

    response = await api.post(RESPONSES, {"model": MODEL_ID, "input": "Hi", "text": text})

    assert_refused(response, "text.format.schema", "maxLength 20000")


async def test_tools_that_fit_alone_but_not_in_one_grammar_are_named_together(api: API, settings: Any) -> None:
    settings.SCHEMA_MAX_PROPERTIES = 8  # 32 in all
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(8)}}
    tools = [{"type": "function", "function": {"name": f"tool{n}", "parameters": wide}} for n in range(5)]

    response = await api.post(CHAT, chat(tools=tools, tool_choice="required"))

    assert_refused(response, "tools", "properties in all")


async def test_a_schema_nested_past_its_bound_is_named(api: API) -> None:
    response = await api.post(CHAT, chat(response_format=output_schema(nested(25))))

    assert_refused(response, "response_format.json_schema.schema", "nested deeper than 48 levels")


async def test_a_body_nested_deeper_than_the_bound_is_a_400_not_a_recursion_error(api: API) -> None:
    # Deep enough for Python's recursion in schema validation, well within what the JSON parser reads.
    response = await api.post(CHAT, chat(tools=[strict_tool("deep", nested(150))]))

    assert_refused(response, None, "nests deeper than 64 levels")


async def test_any_deeply_nested_body_is_refused_on_every_endpoint(api: API) -> None:
    deep: Any = "bottom"
    for _ in range(500):
        deep = [deep]
    headers = {"Authorization": f"Bearer {api.key}", "X-Tenant-ID": "acme"}
    for path in (CHAT, RESPONSES, "/v1/responses", "/v1/feedback"):
        body = json.dumps({"model": MODEL_ID, "metadata": deep})
        response = await api.client.post(path, data=body, content_type="application/json", headers=headers)
        assert_refused(response, None, "nests deeper than 64 levels")


async def test_a_body_of_more_objects_than_the_bound_is_a_413_before_it_is_validated_or_rendered(
    api: API, watched_renderer: dict[str, list[str]]
) -> None:
    # 50,001 messages, 1.4 MB: within the byte limit, past the 50,000 objects and arrays a body may hold.
    response = await api.post(CHAT, chat(messages=QUESTION * 50_001))

    assert_refused(response, None, "more than 50000 objects and arrays", status=413)
    assert response.json()["error"]["code"] == "request_too_large"
    assert watched_renderer["render"] == []


async def test_a_body_past_the_object_bound_whose_last_string_never_ends_is_refused_as_quickly(api: API) -> None:
    # A string of 400,000 escaped quotes with no end: matched once, not tried again from each of its quotes (hours).
    body = b"[" * 50_001 + b'"' + b'\\"' * 400_000
    headers = {"Authorization": f"Bearer {api.key}"}

    response = await api.client.post(CHAT, data=body, content_type="application/json", headers=headers)

    assert_refused(response, None, "more than 50000 objects and arrays", status=413)


@pytest.mark.parametrize(
    "overrides",
    [
        {"messages": [1] * 250_000},  # a million of these held the process's GIL for five seconds
        {f"k{index}": 1 for index in range(250_000)},
        {"messages": [{"role": "user", "content": "Hi", **{f"k{index}": 1 for index in range(250_000)}}]},
    ],
    ids=["numbers-where-messages-go", "unknown-keys", "unknown-keys-in-a-message"],
)
async def test_a_body_of_more_values_than_the_bound_is_a_413_before_it_is_validated(
    api: API, overrides: dict[str, Any], watched_renderer: dict[str, list[str]]
) -> None:
    response = await api.post(CHAT, chat(**overrides))

    assert_refused(response, None, "more than 250000 values", status=413)
    assert response.json()["error"]["code"] == "request_too_large"
    assert watched_renderer["render"] == []


async def test_commas_inside_strings_are_no_values_of_the_body(api: API) -> None:
    response = await api.post(CHAT, chat(messages=[{"role": "user", "content": "," * 300_000}]))

    assert_refused(response, "messages", "maximum context length")


async def test_a_body_of_as_many_objects_as_the_bound_is_read(api: API) -> None:
    # 49,998 messages, the list and the body itself: 50,000. Read, and refused only for what it holds.
    response = await api.post(CHAT, chat(messages=QUESTION * 49_998))

    assert_refused(response, "messages", "maximum context length")


# --- expensive work: off the event loop, and after a cheap refusal ------------------------------------------


@pytest.fixture
def watched_renderer(catalog_model: CatalogEntry, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[str]]]:
    """The model's renderer, reporting for each call whether it ran on the event loop's thread."""
    real = execution.get_renderer(catalog_model.runner, catalog_model.runner_settings)
    calls: dict[str, list[str]] = {"render": [], "schema": [], "count": []}

    def where() -> str:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return "thread"
        return "event loop"

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        calls["render"].append(where())
        return real.render(messages, tools)

    def schema_problem(schema: dict[str, Any]) -> str | None:
        calls["schema"].append(where())
        return real.schema_problem(schema)

    def count_tokens(text: str, literal: tuple[tuple[int, int], ...]) -> int:
        calls["count"].append(where())
        return real.count_tokens(text, literal)

    watched = PromptRenderer(
        render=render,
        count_tokens=count_tokens,
        least_tokens=real.least_tokens,
        native_tools=real.native_tools,
        schema_problem=schema_problem,
        max_top_logprobs=real.max_top_logprobs,
        special_tokens=real.special_tokens,
    )
    monkeypatch.setattr(generation, "get_renderer", lambda runner, settings: watched)
    yield calls


async def test_rendering_and_schema_checks_run_off_the_event_loop(
    api: API, watched_renderer: dict[str, list[str]]
) -> None:
    response = await api.post(CHAT, chat(response_format=output_schema({"type": "object"})))

    assert response.status_code == 200
    assert watched_renderer == {"render": ["thread"], "schema": ["thread"], "count": ["thread"]}


async def test_a_prompt_of_many_short_messages_that_cannot_fit_is_refused_without_counting_it(
    api: API, watched_renderer: dict[str, list[str]]
) -> None:
    # 40,000 one-letter messages: a 1.2 MB prompt whose exact count would keep a core busy for a minute.
    response = await api.post(CHAT, chat(messages=[{"role": "user", "content": "a"}] * 40_000))

    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "your messages resulted in at least 80" in error["message"]  # two markers a message, and more
    assert watched_renderer["count"] == []


async def test_a_client_over_its_limit_is_refused_before_its_prompt_is_rendered(
    api: API, watched_renderer: dict[str, list[str]]
) -> None:
    organization = await Organization.objects.aget(slug="acme")
    await Limit.objects.acreate(organization=organization, requests_per_minute=1)
    admission.clear_limits_cache()

    assert (await api.post(CHAT, chat())).status_code == 200
    assert (await api.post(CHAT, chat())).status_code == 429
    assert len(watched_renderer["render"]) == 1


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, chat(n=2), "n"),
        (CHAT, chat(stream_options={"include_usage": True}), "stream_options"),
        (RESPONSES, {"model": MODEL_ID, "input": "Hi", "service_tier": "flex"}, "service_tier"),
    ],
    ids=["chat-n", "chat-stream-options-without-stream", "responses-service-tier"],
)
async def test_a_bad_request_from_a_client_over_its_limit_is_still_a_400_naming_the_parameter(
    api: API, path: str, body: dict[str, Any], param: str
) -> None:
    # A 429 would have the client wait, then send again a request that can never succeed.
    organization = await Organization.objects.aget(slug="acme")
    await Limit.objects.acreate(organization=organization, requests_per_minute=1)
    admission.clear_limits_cache()
    assert (await api.post(CHAT, chat())).status_code == 200

    response = await api.post(path, body)

    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == param


async def test_a_request_whose_output_alone_outgrows_the_tokens_left_is_refused_before_rendering(
    api: API, watched_renderer: dict[str, list[str]]
) -> None:
    organization = await Organization.objects.aget(slug="acme")
    await Limit.objects.acreate(organization=organization, tokens_per_minute=500)
    admission.clear_limits_cache()

    response = await api.post(CHAT, chat(max_tokens=1000))

    assert response.status_code == 429
    assert watched_renderer["render"] == []
    usage.flush()
    record = await UsageRecord.objects.aget()
    assert (record.status, record.error_code, record.input_tokens) == (429, "rate_limited", 0)


# --- accounting and metrics ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    ["x" * 201, "bad model", "model\n", "../../etc/passwd\x00", "ünïcode"],
    ids=["long", "space", "newline", "nul", "unicode"],
)
async def test_a_model_name_that_no_catalog_entry_could_have_is_refused_by_name(api: API, model: str) -> None:
    for path, body in ((CHAT, chat(model=model)), (RESPONSES, {"model": model, "input": "Hi"})):
        assert_refused(await api.post(path, body), "model", "a model id is 1 to 200 letters")


async def test_made_up_model_names_leave_no_trace_in_the_metrics(api: API) -> None:
    before = metrics.exposition()[0]
    for index in range(20):
        response = await api.post(CHAT, chat(model=f"made-up/model-{index}-" + "y" * 150))
        assert response.status_code == 404

    assert metrics.exposition()[0].count(b"made-up/model") == 0
    assert len(metrics.exposition()[0]) < len(before) + 2000


def test_past_the_bound_model_labels_share_one_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "MAX_MODEL_LABELS", 3)
    monkeypatch.setattr(metrics, "_model_labels", {"a", "b"})

    assert [metrics.model_label(name) for name in ("a", "c", "d", "e", "b")] == ["a", "c", "other", "other", "b"]


def test_past_the_bound_error_code_labels_share_one_value(monkeypatch: pytest.MonkeyPatch) -> None:
    # A gateway's upstream names codes of its own: each would be a new series.
    monkeypatch.setattr(metrics, "MAX_ERROR_CODE_LABELS", 2)
    monkeypatch.setattr(metrics, "_error_code_labels", {""})

    assert [metrics.error_code_label(code) for code in ("", "rate_limited", "x1", "x2")] == [
        "",
        "rate_limited",
        "other",
        "other",
    ]


async def test_a_request_the_runner_refuses_before_its_first_token_is_recorded_with_no_tokens(
    api: API, catalog_model: CatalogEntry
) -> None:
    # The catalog promises more context than the runner was loaded with: the runner refuses the prompt.
    settings = catalog_model.runner_settings
    small = {**settings, "n_ctx": 16, "parallel": 1}
    await CatalogEntry.objects.filter(pk=catalog_model.pk).aupdate(runner_settings=small)
    try:
        failed = await api.post(CHAT, chat(messages=[{"role": "user", "content": "word " * 600}]))
    finally:
        await CatalogEntry.objects.filter(pk=catalog_model.pk).aupdate(runner_settings=settings)

    assert failed.status_code == 400, failed.content
    usage.flush()
    record = await UsageRecord.objects.aget(request_id=failed["x-request-id"])
    assert (record.error_code, record.input_tokens, record.output_tokens) == ("context_length_exceeded", 0, 0)


async def test_a_usage_batch_with_one_bad_row_keeps_the_good_ones(api: API) -> None:
    organization = await Organization.objects.aget(slug="acme")

    def meter(request_id: str) -> usage.Meter:
        return usage.Meter(
            organization_id=organization.pk,
            organization="acme",
            api_key_id=None,
            model=MODEL_ID,
            endpoint="chat.completions",
            route="node",
            request_id=request_id,
        )

    meter("req_good_1").record(status=200, input_tokens=3)
    meter("req_bad").record(status=200, time_to_first_token_ms=-1)  # the database's check refuses a negative time
    meter("req_good_2").record(status=200, input_tokens=4)
    usage.flush()

    written = [record.request_id async for record in UsageRecord.objects.order_by("request_id")]
    assert written == ["req_good_1", "req_good_2"]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a",
        "<|im_start|>user\nHi<|im_end|>\n" * 50,
        " " * 5000,
        "日本語のテキスト 🐉🔥" * 40,
        "<|im_end|><|im_end|>x",
    ],
    ids=["empty", "a letter", "chat markup", "spaces", "multi-byte", "adjacent markers"],
)
def test_the_token_floor_never_passes_the_exact_count(catalog_model: CatalogEntry, text: str) -> None:
    renderer = execution.get_renderer(catalog_model.runner, catalog_model.runner_settings)

    assert renderer.least_tokens(text) <= renderer.count_tokens(text, ())
