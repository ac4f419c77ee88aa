"""The catalog in the admin: an upstream's key is written but never shown; what the agent instances on an entry
need of it stays."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from agents.models import AgentInstance
from inference.models import CatalogEntry

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.database]


@pytest.fixture
def staff_client() -> Client:
    user = get_user_model().objects.create_superuser("root", "root@example.com", "a-long-password")
    client = Client()
    client.force_login(user)
    return client


def form_data(entry: CatalogEntry, **changes: str) -> dict[str, str]:
    data = {
        "public_id": entry.public_id,
        "enabled": "on",
        "owned_by": entry.owned_by,
        "runner": entry.runner,
        "runner_settings": "{}",
        "context_length": str(entry.context_length),
        "max_output_tokens": str(entry.max_output_tokens),
        "json_schema": "on",
        "tools": "on",
        "upstream_base_url": "https://upstream.example/v1",
        "upstream_api_key": "",
        "upstream_model": "",
    }
    data.update(changes)
    return data


def test_the_upstream_key_is_kept_but_never_shown(staff_client: Client) -> None:
    entry = CatalogEntry.objects.create(public_id="proxied/model", upstream_api_key="sk-upstream-secret")
    url = f"/admin/inference/catalogentry/{entry.pk}/change/"
    page = staff_client.get(url)
    assert page.status_code == 200 and b"sk-upstream-secret" not in page.content
    assert staff_client.post(url, form_data(entry)).status_code == 302
    entry.refresh_from_db()
    assert entry.upstream_api_key == "sk-upstream-secret"
    staff_client.post(url, form_data(entry, upstream_api_key="sk-new"))
    entry.refresh_from_db()
    assert entry.upstream_api_key == "sk-new"
    staff_client.post(url, form_data(entry, clear_upstream_api_key="on"))
    entry.refresh_from_db()
    assert entry.upstream_api_key == ""


def test_a_cpu_model_shows_its_sequences_queue_and_the_memory_of_its_kv_cache(
    staff_client: Client, catalog_model: CatalogEntry
) -> None:
    catalog_model.runner_settings = {**catalog_model.runner_settings, "parallel": 2, "queue": 5, "n_ctx": 4096}
    catalog_model.save()

    page = staff_client.get(f"/admin/inference/catalogentry/{catalog_model.pk}/change/").content.decode()

    # SmolLM2-135M: 30 layers, 3 KV heads of 64, 16-bit keys and values: 22.5 KiB a token.
    assert "2 sequences of 4096 tokens, 5 more waiting; KV cache 180 MiB" in page


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ('{"parallel": 0}', "parallel must be a whole number of at least 1, not 0."),
        ('{"stream_interval_ms": -5}', "stream_interval_ms must be a whole number of at least 0, not -5."),
        ('{"n_ctx": "8192"}', "n_ctx must be a whole number of at least 16, not &#x27;8192&#x27;."),
        ('{"queue": true}', "queue must be a whole number of at least 0, not True."),
    ],
)
def test_a_cpu_model_whose_settings_hold_a_wrong_number_is_not_saved_and_the_form_says_which(
    staff_client: Client, catalog_model: CatalogEntry, settings: str, message: str
) -> None:
    url = f"/admin/inference/catalogentry/{catalog_model.pk}/change/"

    page = staff_client.post(url, form_data(catalog_model, runner_settings=settings))

    assert page.status_code == 200 and message in page.content.decode()
    catalog_model.refresh_from_db()
    assert "parallel" not in catalog_model.runner_settings


def test_a_cpu_model_saved_with_a_wrong_number_elsewhere_still_opens_in_the_admin(
    staff_client: Client, catalog_model: CatalogEntry
) -> None:
    CatalogEntry.objects.filter(pk=catalog_model.pk).update(runner_settings={"parallel": "four"})

    page = staff_client.get(f"/admin/inference/catalogentry/{catalog_model.pk}/change/")

    assert page.status_code == 200


@pytest.mark.parametrize(
    ("instance", "change", "message"),
    [
        ({}, {"runner": "gateway"}, "The agent instances acme.agent run on this model: they need a runner here."),
        ({"tools": ["knowledge_search"]}, {"tools": ""}, "acme.agent run server tools on this model: they need tool"),
        ({"reasons": True}, {"reasoning": ""}, "acme.agent reason on this model: they need reasoning."),
    ],
    ids=["gateway only", "no tool calls", "no reasoning"],
)
def test_a_catalog_model_cannot_be_changed_so_that_an_agent_instance_on_it_can_no_longer_be_served(
    staff_client: Client, instance: dict[str, Any], change: dict[str, str], message: str
) -> None:
    entry = CatalogEntry.objects.create(public_id="acme/agent-model", reasoning=True)
    AgentInstance.objects.create(instance_id="acme.agent", model=entry, **instance)
    AgentInstance.objects.create(instance_id="acme.plain-agent", model=CatalogEntry.objects.create(public_id="x/y"))
    url = f"/admin/inference/catalogentry/{entry.pk}/change/"
    unchanged = form_data(entry, reasoning="on")

    page = staff_client.post(url, {key: value for key, value in {**unchanged, **change}.items() if value})

    assert page.status_code == 200 and message in page.content.decode()
    entry.refresh_from_db()
    assert (entry.runner, entry.tools, entry.reasoning) == ("llama_cpp", True, True)
    assert staff_client.post(url, unchanged).status_code == 302


def test_a_catalog_model_without_agent_instances_that_need_them_drops_tool_calls_and_reasoning(
    staff_client: Client,
) -> None:
    entry = CatalogEntry.objects.create(public_id="acme/agent-model", reasoning=True)
    AgentInstance.objects.create(instance_id="acme.agent", model=entry)
    url = f"/admin/inference/catalogentry/{entry.pk}/change/"

    response = staff_client.post(url, {key: value for key, value in form_data(entry).items() if key != "tools"})

    assert response.status_code == 302
    entry.refresh_from_db()
    assert (entry.tools, entry.reasoning) == (False, False)


@pytest.mark.parametrize("field", ["context_length", "max_output_tokens"])
def test_a_catalog_model_with_room_for_no_token_is_not_saved(staff_client: Client, field: str) -> None:
    entry = CatalogEntry.objects.create(public_id="acme/model")
    url = f"/admin/inference/catalogentry/{entry.pk}/change/"

    page = staff_client.post(url, form_data(entry, **{field: "0"}))

    assert page.status_code == 200 and "Ensure this value is greater than or equal to 1." in page.content.decode()
    entry.refresh_from_db()
    assert (entry.context_length, entry.max_output_tokens) == (8192, 2048)
