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
