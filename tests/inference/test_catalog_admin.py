"""The catalog in the admin: an upstream's key is written but never shown."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

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
