"""Tenancy: X-Tenant-ID must name the key's organization, and nothing of another tenant is ever visible:
not its instances, not its stored responses, not its feedback. None of these tests runs the model."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings
from django.utils import timezone

from agents.models import AgentInstance, Feedback, StoredResponse
from agents.protocol import FEEDBACK_META_MAX_BYTES
from agents.services import prune_responses
from orgs.models import Organization
from tests.agents.conftest import Tenant
from tests.conftest import read_stream

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.database]

ENDPOINTS = [
    ("post", "/v1/responses"),
    ("get", "/v1/instances"),
    ("post", "/v1/feedback"),
    ("get", "/v1/responses/resp_acme"),
]


async def call(client: Tenant, method: str, path: str, **who: str | None) -> object:
    if method == "get":
        return await client.get(path, **who)
    return await client.post(path, {}, **who)


def assert_error(response: object, status: int, code: str, type_: str = "invalid_request_error") -> dict:
    assert response.status_code == status, response.content  # type: ignore[attr-defined]
    error = response.json()["error"]  # type: ignore[attr-defined]
    assert (error["code"], error["type"]) == (code, type_) and error["message"]
    return error


@pytest.fixture
def globex_instance(make_instance: Callable[..., AgentInstance], other_tenant: Tenant) -> AgentInstance:
    instance = make_instance("globex.agent.private")
    instance.organizations.set(Organization.objects.filter(slug=other_tenant.slug))
    return instance


def stored(instance: AgentInstance, organization: Organization, response_id: str, **fields: object) -> StoredResponse:
    return StoredResponse.objects.create(
        response_id=response_id,
        organization=organization,
        instance=instance,
        thread=fields.pop("thread", response_id),
        status="completed",
        input_items=[{"type": "message", "role": "user", "content": "Hello"}],
        output_items=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]}],
        **fields,
    )


@pytest.fixture
def globex_response(globex_instance: AgentInstance, other_tenant: Tenant) -> StoredResponse:
    return stored(globex_instance, Organization.objects.get(slug=other_tenant.slug), "resp_globex")


@pytest.fixture
def acme_response(make_instance: Callable[..., AgentInstance], organization: Organization) -> StoredResponse:
    return stored(make_instance("acme.agent"), organization, "resp_acme")


# --- the tenant header ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
async def test_a_request_without_a_tenant_is_refused_with_400(tenant: Tenant, method: str, path: str) -> None:
    error = assert_error(await call(tenant, method, path, tenant=""), 400, "missing_tenant_id")
    assert "X-Tenant-ID" in error["message"]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
@pytest.mark.parametrize("claimed", ["globex", "nobody"], ids=["another-tenant", "unknown-tenant"])
async def test_a_tenant_other_than_the_keys_organization_is_refused_alike_whether_it_exists_or_not(
    tenant: Tenant, other_tenant: Tenant, method: str, path: str, claimed: str
) -> None:
    error = assert_error(
        await call(tenant, method, path, tenant=claimed), 403, "tenant_mismatch", "invalid_request_error"
    )
    assert error["message"] == "The tenant in X-Tenant-ID is not the organization of this API key."


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/v1/responses/resp_acme"),
        ("delete", "/v1/responses/resp_acme"),
        ("post", "/v1/responses/resp_acme/cancel"),
        ("get", "/v1/responses/resp_acme/input_items"),
    ],
    ids=["retrieve", "delete", "cancel", "input-items"],
)
async def test_a_stored_response_is_not_offered_by_id_and_the_answer_says_how_to_go_on(
    tenant: Tenant, acme_response: StoredResponse, method: str, path: str
) -> None:
    response = await getattr(tenant.client, method)(path, headers=tenant.headers())

    error = assert_error(response, 404, "not_found")
    assert "previous_response_id" in error["message"] and "days after their last turn" in error["message"]
    assert await StoredResponse.objects.filter(response_id="resp_acme").aexists()


async def test_counting_input_tokens_is_not_offered_and_the_answer_says_where_usage_is_told(tenant: Tenant) -> None:
    response = await tenant.client.post("/v1/responses/input_tokens", headers=tenant.headers())

    error = assert_error(response, 404, "not_found")
    assert "does not count input tokens" in error["message"] and "usage" in error["message"]


async def test_a_bad_key_is_refused_before_the_tenant_is_looked_at(tenant: Tenant) -> None:
    assert_error(await tenant.get("/v1/instances", key="b3os_nope"), 401, "invalid_api_key", "invalid_request_error")


# --- instances --------------------------------------------------------------------------------------------


async def test_instances_lists_only_the_enabled_instances_the_tenant_may_use(
    tenant: Tenant, make_instance: Callable[..., AgentInstance], globex_instance: AgentInstance
) -> None:
    await sync_to_async(make_instance)("acme.agent.b", name="B", tools=["knowledge_search"])
    await sync_to_async(make_instance)("acme.agent.a", name="A")
    await sync_to_async(make_instance)("acme.agent.off", enabled=False)

    response = await tenant.get("/v1/instances")

    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list" and [i["id"] for i in body["data"]] == ["acme.agent.a", "acme.agent.b"]
    assert body["data"][1] == {
        "id": "acme.agent.b",
        "object": "agent_runtime.instance",
        "created": body["data"][1]["created"],
        "name": "B",
        "base_model": "b3os/smollm2-135m-instruct",
        "tools": ["knowledge_search"],
        "reasoning": False,
    }


async def test_another_tenants_instance_is_not_found_as_if_it_did_not_exist(
    tenant: Tenant, globex_instance: AgentInstance
) -> None:
    theirs = await tenant.post("/v1/responses", {"model": globex_instance.instance_id, "input": "Hi", "stream": True})
    missing = await tenant.post("/v1/responses", {"model": "no.such.agent", "input": "Hi", "stream": True})

    error = assert_error(theirs, 404, "model_not_found", "invalid_request_error")
    assert error["param"] == "model" and "globex.agent.private" in error["message"]
    assert assert_error(missing, 404, "model_not_found", "invalid_request_error")["message"] == error[
        "message"
    ].replace("globex.agent.private", "no.such.agent")


@pytest.fixture
def on_a_disabled_model(make_instance: Callable[..., AgentInstance]) -> AgentInstance:
    instance = make_instance("acme.paused")
    instance.model.enabled = False
    instance.model.save()
    return instance


async def test_the_tenants_instance_on_a_disabled_model_is_unavailable_for_now_not_missing(
    tenant: Tenant, on_a_disabled_model: AgentInstance
) -> None:
    response = await tenant.post("/v1/responses", {"model": "acme.paused", "input": "Hi", "stream": True})

    error = assert_error(response, 503, "model_not_available", "server_error")
    assert "the model it runs on is disabled" in error["message"] and response.headers["Retry-After"]


@pytest.fixture
def on_a_model_that_cannot_load(make_instance: Callable[..., AgentInstance]) -> AgentInstance:
    instance = make_instance("acme.stranded")
    # Saved around the admin's checks (a shell, SQL), or its file removed since.
    type(instance.model).objects.filter(pk=instance.model.pk).update(
        runner_settings={"model_path": "/nonexistent/model.gguf"}
    )
    return instance


async def test_the_tenants_instance_on_a_model_that_cannot_load_is_unavailable_not_a_server_error(
    tenant: Tenant, on_a_model_that_cannot_load: AgentInstance
) -> None:
    response = await tenant.post("/v1/responses", {"model": "acme.stranded", "input": "Hi", "stream": True})

    assert_error(response, 503, "model_not_available", "server_error")


# --- stored responses --------------------------------------------------------------------------------------


async def test_another_tenants_response_cannot_be_continued_and_reads_as_missing(
    tenant: Tenant, acme_response: StoredResponse, globex_response: StoredResponse
) -> None:
    body = {"model": "acme.agent", "input": "Go on.", "stream": True}
    theirs = await tenant.post("/v1/responses", {**body, "previous_response_id": "resp_globex"})
    missing = await tenant.post("/v1/responses", {**body, "previous_response_id": "resp_missing"})

    first = assert_error(theirs, 400, "previous_response_not_found")
    second = assert_error(missing, 400, "previous_response_not_found")
    assert first["param"] == second["param"] == "previous_response_id"
    assert first["message"] == second["message"].replace("resp_missing", "resp_globex")
    assert "store: true" in first["message"]


@pytest.fixture
def acme_other(make_instance: Callable[..., AgentInstance]) -> AgentInstance:
    return make_instance("acme.other")


async def test_a_conversation_goes_on_only_with_the_instance_it_began_with(
    tenant: Tenant, acme_other: AgentInstance, acme_response: StoredResponse
) -> None:
    # Another instance of the same organization would read what the first one's tools found.
    body = {"input": "Repeat what you were told.", "stream": True, "previous_response_id": "resp_acme"}

    error = assert_error(
        await tenant.post("/v1/responses", {**body, "model": "acme.other"}), 400, "previous_response_not_found"
    )

    assert error["param"] == "previous_response_id" and "agent instance (model) it began with" in error["message"]


@pytest.mark.parametrize("response_id", ["resp_\x00", "resp_acme' OR 1=1", "chatcmpl-123", "resp_" + "a" * 60])
async def test_a_previous_response_id_that_cannot_be_one_of_the_runtimes_is_refused_by_name(
    tenant: Tenant, acme_response: StoredResponse, response_id: str
) -> None:
    body = {"model": "acme.agent", "input": "Go on.", "stream": True, "previous_response_id": response_id}

    error = assert_error(await tenant.post("/v1/responses", body), 400, "invalid_value")

    assert error["param"] == "previous_response_id" and "'resp_'" in error["message"]


@override_settings(AGENT_RESPONSE_RETENTION_DAYS=30)
async def test_a_response_past_its_retention_cannot_be_continued(tenant: Tenant, acme_response: StoredResponse) -> None:
    await StoredResponse.objects.filter(pk=acme_response.pk).aupdate(created=timezone.now() - timedelta(days=31))

    response = await tenant.post(
        "/v1/responses", {"model": "acme.agent", "input": "Go on.", "stream": True, "previous_response_id": "resp_acme"}
    )

    assert_error(response, 400, "previous_response_not_found")


@override_settings(AGENT_RESPONSE_RETENTION_DAYS=30)
async def test_an_old_turn_of_a_conversation_still_in_use_can_be_branched_from_and_rated(
    tenant: Tenant, acme_response: StoredResponse
) -> None:
    await StoredResponse.objects.filter(pk=acme_response.pk).aupdate(created=timezone.now() - timedelta(days=31))
    await sync_to_async(stored)(
        acme_response.instance, acme_response.organization, "resp_next", thread="resp_acme", previous=acme_response
    )

    branch = await tenant.post(
        "/v1/responses",
        {
            "model": "acme.agent",
            "input": "Go on.",
            "stream": True,
            "previous_response_id": "resp_acme",
            "max_output_tokens": 16,
        },
    )
    assert branch.status_code == 200, branch.content
    assert "response.completed" in await read_stream(branch)
    rated = await tenant.post("/v1/feedback", {"meta": {"message_id": "resp_acme"}, "rating": "positive"})
    assert rated.status_code == 200


@override_settings(AGENT_RESPONSE_RETENTION_DAYS=30)
def test_pruning_deletes_conversations_whose_last_turn_is_past_retention_and_keeps_the_others(
    make_instance: Callable[..., AgentInstance], organization: Organization
) -> None:
    instance, old = make_instance("acme.agent"), timezone.now() - timedelta(days=40)
    stale = stored(instance, organization, "resp_stale", created=old)
    Feedback.objects.create(response=stale, rating="negative")
    first = stored(instance, organization, "resp_first", created=old)
    stored(instance, organization, "resp_recent", thread="resp_first", previous=first)

    assert prune_responses() == 1

    assert sorted(StoredResponse.objects.values_list("response_id", flat=True)) == ["resp_first", "resp_recent"]
    assert not Feedback.objects.exists()


# --- feedback ---------------------------------------------------------------------------------------------


async def test_feedback_rates_a_stored_answer_and_rating_again_replaces_it(
    tenant: Tenant, acme_response: StoredResponse
) -> None:
    body = {"meta": {"message_id": "resp_acme", "conversation": "c-1"}, "rating": "negative", "comment": "Wrong part."}
    first = await tenant.post("/v1/feedback", body)
    again = await tenant.post("/v1/feedback", {**body, "rating": "positive", "comment": None})

    assert first.status_code == again.status_code == 200
    assert first.json() == {
        "object": "agent_runtime.feedback",
        "message_id": "resp_acme",
        "rating": "negative",
        "comment": "Wrong part.",
        "created_at": first.json()["created_at"],
    }
    feedback = await Feedback.objects.aget()
    assert (feedback.rating, feedback.comment, feedback.response_id) == ("positive", "", acme_response.pk)
    assert feedback.meta == {"message_id": "resp_acme", "conversation": "c-1"}


async def test_feedback_on_another_tenants_response_is_not_found_and_changes_nothing(
    tenant: Tenant, globex_response: StoredResponse
) -> None:
    response = await tenant.post("/v1/feedback", {"meta": {"message_id": "resp_globex"}, "rating": "negative"})

    error = assert_error(response, 404, "response_not_found", "invalid_request_error")
    assert error["param"] == "meta.message_id"
    assert not await Feedback.objects.aexists()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"meta": {"message_id": "resp_acme"}, "rating": "meh"}, "rating"),
        ({"rating": "positive"}, "meta"),
        ({"meta": {}, "rating": "positive"}, "meta.message_id"),
        ({"meta": {"message_id": "resp_acme"}, "rating": "positive", "stars": 5}, "stars"),
        # U+0000, which PostgreSQL can neither compare nor keep: a 400, not the database's error as a 500.
        ({"meta": {"message_id": "resp_\x00"}, "rating": "positive"}, "meta.message_id"),
        ({"meta": {"message_id": "resp_acme"}, "rating": "positive", "comment": "Wrong\x00"}, "comment"),
        ({"meta": {"message_id": "resp_acme", "ticket": ["T-1\x00"]}, "rating": "positive"}, "meta"),
        ({"meta": {"message_id": "resp_acme", "tag\x00": "x"}, "rating": "positive"}, "meta"),
    ],
    ids=[
        "rating",
        "no meta",
        "no message_id",
        "unknown field",
        "a nul in the id",
        "in the comment",
        "in meta",
        "in a name in meta",
    ],
)
async def test_feedback_names_the_field_that_is_wrong(
    tenant: Tenant, acme_response: StoredResponse, body: dict, param: str
) -> None:
    response = await tenant.post("/v1/feedback", body)

    assert response.status_code == 400 and response.json()["error"]["param"] == param


async def test_a_comment_past_its_length_is_refused_in_openais_words(
    tenant: Tenant, acme_response: StoredResponse
) -> None:
    body = {"meta": {"message_id": "resp_acme"}, "rating": "negative", "comment": "x" * 4001}

    response = await tenant.post("/v1/feedback", body)

    error = assert_error(response, 400, "string_above_max_length")
    assert error["param"] == "comment"
    assert error["message"] == (
        "Invalid 'comment': string too long. Expected a string with maximum length 4000, "
        "but got a string with length 4001 instead."
    )


async def test_what_a_client_adds_to_meta_is_kept_only_up_to_a_bound(
    tenant: Tenant, acme_response: StoredResponse
) -> None:
    body = {
        "meta": {"message_id": "resp_acme", "transcript": "x" * (FEEDBACK_META_MAX_BYTES + 1)},
        "rating": "negative",
    }

    response = await tenant.post("/v1/feedback", body)

    error = assert_error(response, 400, "invalid_value")
    assert error["param"] == "meta" and str(FEEDBACK_META_MAX_BYTES) in error["message"]
    assert not await Feedback.objects.aexists()
    ticket = {"message_id": "resp_acme", "ticket": "T-1", "tags": ["bracket"] * 100}
    assert (await tenant.post("/v1/feedback", {**body, "meta": ticket})).status_code == 200
