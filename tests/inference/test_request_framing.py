"""How a request is framed on the wire: chunked bodies, content codings and HEAD, as the server sees them.

These go through the ASGI application that ``manage.py serve`` runs (Django's test client always declares
a ``Content-Length`` and drops the body of HEAD answers itself, so it would hide all three).
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from django.test import RequestFactory, override_settings

from config.asgi import application
from inference.api import middleware
from orgs.models import Organization
from tests.conftest import API, MODEL_ID

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/infer/chat/completions"
UNKNOWN_MODEL = {"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]}


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def asgi(method: str, path: str, *, headers: dict[str, str], chunks: Sequence[bytes] = ()) -> Answer:
    """One request to the served application, its body sent in ``chunks`` as a server relays a chunked body."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(name.lower().encode(), value.encode()) for name, value in headers.items()],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
    }
    incoming = [{"type": "http.request", "body": chunk, "more_body": True} for chunk in chunks]
    incoming.append({"type": "http.request", "body": b"", "more_body": False})
    sent: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            done.set()

    await asyncio.wait_for(application(scope, receive, send), timeout=60)
    start = next(message for message in sent if message["type"] == "http.response.start")
    return Answer(
        status=start["status"],
        headers={name.decode().lower(): value.decode() for name, value in start["headers"]},
        body=b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body"),
    )


def chunked(api: API, **extra: str) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {api.key}",
        "Content-Type": "application/json",
        "Transfer-Encoding": "chunked",
        **extra,
    }


def pieces(body: bytes, size: int = 7) -> list[bytes]:
    return [body[start : start + size] for start in range(0, len(body), size)]


def assert_error(answer: Answer, status: int, code: str) -> dict[str, Any]:
    assert answer.status == status, answer.body
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert re.fullmatch(r"req_[0-9a-z]{26}", answer.headers["x-request-id"])
    assert answer.headers["server-timing"].startswith("total;dur=")
    return error


# Chunked bodies


async def test_a_chunked_body_is_parsed_like_any_other(api: API) -> None:
    answer = await asgi("POST", CHAT, headers=chunked(api), chunks=pieces(json.dumps(UNKNOWN_MODEL).encode()))
    error = assert_error(answer, 404, "model_not_available")
    assert "no-such-model" in error["message"]


async def test_a_chunked_request_is_answered(api: API) -> None:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    answer = await asgi("POST", CHAT, headers=chunked(api), chunks=pieces(json.dumps(body).encode(), 16))
    assert answer.status == 200, answer.body
    assert answer.json()["object"] == "chat.completion"


@override_settings(MAX_REQUEST_BODY_BYTES=2048, DATA_UPLOAD_MAX_MEMORY_SIZE=2048)
async def test_a_chunked_body_over_the_limit_is_a_413_like_a_declared_one(api: API) -> None:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "x" * 5000}]}
    answer = await asgi("POST", CHAT, headers=chunked(api), chunks=pieces(json.dumps(body).encode(), 1000))
    assert_error(answer, 413, "request_too_large")


@override_settings(MAX_REQUEST_BODY_BYTES=2048, DATA_UPLOAD_MAX_MEMORY_SIZE=2048)
async def test_a_chunked_body_at_the_limit_is_let_through(api: API) -> None:
    raw = json.dumps(UNKNOWN_MODEL).encode()
    raw += b" " * (2048 - len(raw))
    answer = await asgi("POST", CHAT, headers=chunked(api), chunks=pieces(raw, 500))
    assert_error(answer, 404, "model_not_available")


async def test_an_empty_chunked_body_names_the_missing_model(api: API) -> None:
    answer = await asgi("POST", CHAT, headers=chunked(api))
    error = assert_error(answer, 400, "missing_required_parameter")
    assert error["param"] == "model"


async def test_a_body_with_a_declared_length_is_answered_as_before(api: API) -> None:
    raw = json.dumps(UNKNOWN_MODEL).encode()
    headers = {"Authorization": f"Bearer {api.key}", "Content-Type": "application/json"}
    answer = await asgi("POST", CHAT, headers={**headers, "Content-Length": str(len(raw))}, chunks=pieces(raw))
    assert_error(answer, 404, "model_not_available")


class Unmeasurable(io.BytesIO):
    def seek(self, *args: Any) -> int:
        raise AssertionError("a body with a declared length was measured")


def test_a_declared_length_is_taken_at_its_word_without_measuring_the_body(rf: RequestFactory) -> None:
    request = rf.post(CHAT, data=b'{"model": "x"}', content_type="application/json")
    request._stream = Unmeasurable(b'{"model": "x"}')  # type: ignore[attr-defined]
    assert middleware._body_length(request) == 14


# Content codings


async def test_a_gzipped_body_is_a_415_that_names_its_coding(api: API) -> None:
    raw = gzip.compress(json.dumps(UNKNOWN_MODEL).encode())
    response = await api.client.post(
        CHAT,
        data=raw,
        content_type="application/json",
        headers={"Authorization": f"Bearer {api.key}", "Content-Encoding": "gzip"},
    )
    assert response.status_code == 415, response.content
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "unsupported_media_type"
    assert "gzip" in error["message"]
    assert response["Accept-Encoding"] == "identity"
    assert re.fullmatch(r"req_[0-9a-z]{26}", response["x-request-id"])


@pytest.mark.parametrize("coding", ["br", "deflate", "zstd", "gzip, identity", "x-custom"])
async def test_any_coding_but_identity_is_refused_even_on_a_plain_body(api: API, coding: str) -> None:
    raw = json.dumps(UNKNOWN_MODEL).encode()
    answer = await asgi("POST", CHAT, headers=chunked(api, **{"Content-Encoding": coding}), chunks=[raw])
    error = assert_error(answer, 415, "unsupported_media_type")
    assert coding in error["message"]


@pytest.mark.parametrize("coding", ["identity", "Identity", " identity "])
async def test_the_identity_coding_is_no_coding(api: API, coding: str) -> None:
    raw = json.dumps(UNKNOWN_MODEL).encode()
    answer = await asgi("POST", CHAT, headers=chunked(api, **{"Content-Encoding": coding}), chunks=[raw])
    assert_error(answer, 404, "model_not_available")


async def test_a_coding_without_a_body_codes_nothing(api: API) -> None:
    answer = await asgi(
        "GET", "/v1/infer/models", headers={"Authorization": f"Bearer {api.key}", "Content-Encoding": "gzip"}
    )
    assert answer.status == 200, answer.body


# HEAD


@pytest.fixture
def get_routes(organization: Organization) -> list[tuple[str, dict[str, str]]]:
    tenant = {"X-Tenant-ID": organization.slug}
    return [
        ("/v1/infer/models", {}),
        (f"/v1/infer/models/{MODEL_ID}", {}),
        ("/v1/infer/models/no-such-model", {}),
        ("/v1/instances", tenant),
        ("/v1/infer/usage", {}),
        ("/v1/openapi.json", {}),
    ]


VARYING = {"x-request-id", "server-timing", "content-length"}


async def test_head_is_answered_wherever_get_is_with_its_status_and_headers_and_no_body(
    api: API, get_routes: list[tuple[str, dict[str, str]]]
) -> None:
    for path, extra in get_routes:
        headers = {"Authorization": f"Bearer {api.key}", **extra}
        got = await asgi("GET", path, headers=headers)
        head = await asgi("HEAD", path, headers=headers)
        assert head.status == got.status, (path, head.body)
        assert head.body == b"", path
        assert {k: v for k, v in head.headers.items() if k not in VARYING} == {
            k: v for k, v in got.headers.items() if k not in VARYING
        }, path
        assert re.fullmatch(r"req_[0-9a-z]{26}", head.headers["x-request-id"])
        assert int(head.headers["content-length"]) == len(got.body), path


async def test_head_without_a_key_is_the_same_401_as_get(api: API) -> None:
    got = await asgi("GET", "/v1/infer/models", headers={})
    head = await asgi("HEAD", "/v1/infer/models", headers={})
    assert got.status == 401
    assert (head.status, head.body) == (401, b"")


async def test_a_get_route_allows_head(api: API) -> None:
    response = await api.post("/v1/infer/models", {})
    assert response.status_code == 405
    assert response["Allow"] == "GET, HEAD"


async def test_head_where_only_post_is_served_is_a_405(api: API) -> None:
    answer = await asgi("HEAD", CHAT, headers={"Authorization": f"Bearer {api.key}"})
    assert answer.status == 405
    assert answer.headers["allow"] == "POST"
    assert answer.body == b""


@pytest.mark.parametrize("path", ["/health", "/metrics"])
async def test_head_on_an_operations_endpoint_is_its_get_without_a_body(api: API, path: str) -> None:
    got = await asgi("GET", path, headers={})
    head = await asgi("HEAD", path, headers={})
    assert head.status == got.status
    assert head.body == b""


# Operations endpoints


@pytest.mark.parametrize("path", ["/health", "/metrics"])
async def test_operations_endpoints_carry_a_request_id_and_timing(api: API, path: str) -> None:
    response = await api.client.get(path)
    assert re.fullmatch(r"req_[0-9a-z]{26}", response["x-request-id"])
    assert response["Server-Timing"].startswith("total;dur=")


# Static files


@pytest.mark.parametrize("path", ["/static/../config/settings.py", "/static/%2e%2e/%2e%2e/config/settings.py"])
async def test_a_static_path_that_climbs_out_of_its_folder_is_not_found_not_a_500(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    answer = await asgi("GET", path, headers={})

    assert answer.status == 404
    assert b"SECRET_KEY" not in answer.body
    assert not [record for record in caplog.records if record.levelname == "ERROR"]


async def test_a_static_file_is_served() -> None:
    answer = await asgi("GET", "/static/admin/css/base.css", headers={})

    assert answer.status == 200 and b"{" in answer.body
