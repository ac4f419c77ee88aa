"""Browsers may call the API from any origin, as OpenAI's API lets them (openai-node's ``dangerouslyAllowBrowser``):
a preflight is answered and every answer says so, with the headers a client reads; the admin's pages do not."""

from __future__ import annotations

import pytest

from tests.conftest import API, MODEL_ID

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/infer/chat/completions"
ORIGIN = "https://playground.example"


async def test_a_browsers_preflight_of_a_chat_completion_is_answered_for_any_origin(api: API) -> None:
    asked = "authorization, content-type, x-stainless-os, x-stainless-retry-count"

    response = await api.client.options(
        CHAT,
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked},
    )

    assert response.status_code == 200
    assert response["Access-Control-Allow-Origin"] == "*"
    assert "POST" in response["Access-Control-Allow-Methods"]
    # A wildcard covers every header but Authorization, which must be named.
    assert {"*", "authorization"} <= {name.strip() for name in response["Access-Control-Allow-Headers"].split(",")}


async def test_an_answer_to_a_browser_lets_it_read_the_request_id_and_the_rate_limits(api: API) -> None:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    response = await api.client.post(
        CHAT, data=body, content_type="application/json", headers={**api._headers(None), "Origin": ORIGIN}
    )

    assert response.status_code == 200
    assert response["Access-Control-Allow-Origin"] == "*"
    exposed = {name.strip() for name in response["Access-Control-Expose-Headers"].split(",")}
    assert {"x-request-id", "retry-after", "x-ratelimit-remaining-requests"} <= exposed


async def test_an_error_answer_is_readable_by_the_browser_too(api: API) -> None:
    response = await api.client.get("/v1/infer/models", headers={"Origin": ORIGIN})

    assert response.status_code == 401
    assert response["Access-Control-Allow-Origin"] == "*"


async def test_the_admin_answers_no_other_origin(api: API) -> None:
    response = await api.client.get("/admin/login/", headers={"Origin": ORIGIN})

    assert "Access-Control-Allow-Origin" not in response
