from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from orgs.models import APIKey, Organization
from orgs.services import create_api_key
from tests.conftest import API, MODEL_ID

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.database]


def assert_invalid_key(response, raw_key: str | None = None) -> None:
    assert response.status_code == 401
    body = response.json()
    assert body == {
        "error": {
            "message": body["error"]["message"],
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    if raw_key:
        assert raw_key not in response.content.decode()


def test_the_database_never_holds_the_raw_key(organization: Organization) -> None:
    raw = create_api_key(organization=organization, name="ci")
    row = APIKey.objects.get(organization=organization)
    stored = " ".join(str(value) for value in APIKey.objects.filter(pk=row.pk).values().first().values())
    assert raw not in stored
    secret = raw.split("_")[2]
    assert secret not in stored
    assert row.prefix == raw.split("_")[1]
    assert row.hashed_key != raw and len(row.hashed_key) == 64


def test_keys_are_high_entropy_and_distinct(organization: Organization) -> None:
    keys = {create_api_key(organization=organization) for _ in range(20)}
    assert len(keys) == 20
    assert all(len(key) >= 50 for key in keys)


async def test_it_accepts_an_active_key_and_records_its_last_use(api: API) -> None:
    response = await api.get("/v1/infer/models")
    assert response.status_code == 200
    key = await APIKey.objects.aget(prefix=api.key.split("_")[1])
    assert key.last_used_at is not None


async def test_it_rejects_a_revoked_key(api: API) -> None:
    key = await APIKey.objects.aget(prefix=api.key.split("_")[1])
    await APIKey.objects.filter(pk=key.pk).aupdate(revoked_at=timezone.now())
    assert_invalid_key(await api.get("/v1/infer/models"), api.key)


async def test_it_rejects_an_expired_key(api: API) -> None:
    await APIKey.objects.filter(prefix=api.key.split("_")[1]).aupdate(expires_at=timezone.now() - timedelta(seconds=1))
    assert_invalid_key(await api.get("/v1/infer/models"), api.key)


async def test_it_accepts_a_key_that_expires_later(api: API) -> None:
    await APIKey.objects.filter(prefix=api.key.split("_")[1]).aupdate(expires_at=timezone.now() + timedelta(days=1))
    assert (await api.get("/v1/infer/models")).status_code == 200


async def test_it_rejects_a_key_of_an_inactive_organization(api: API) -> None:
    await Organization.objects.filter(slug="acme").aupdate(active=False)
    assert_invalid_key(await api.get("/v1/infer/models"), api.key)


async def test_it_rejects_an_unknown_key_with_a_known_prefix(api: API) -> None:
    forged = api.key[:-4] + ("AAAA" if not api.key.endswith("AAAA") else "BBBB")
    assert_invalid_key(await api.get("/v1/infer/models", key=forged), forged)


@pytest.mark.parametrize(
    "header",
    [
        "",
        "Bearer",
        "Bearer ",
        "Basic dXNlcjpwYXNz",
        "Bearer not-a-key",
        "Bearer b3os_short_x",
        "Token b3os_aaaaaaaaaa_" + "b" * 40,
    ],
)
async def test_it_rejects_missing_or_malformed_credentials(api: API, header: str) -> None:
    headers = {"Authorization": header} if header else {}
    response = await api.client.get("/v1/infer/models", headers=headers)
    assert_invalid_key(response)


async def test_a_revoked_key_is_refused_on_inference_too(api: API) -> None:
    await APIKey.objects.filter(prefix=api.key.split("_")[1]).aupdate(revoked_at=timezone.now())
    response = await api.post(
        "/v1/infer/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert_invalid_key(response, api.key)


async def test_a_revocation_takes_effect_at_once_for_a_key_already_in_use(api: API) -> None:
    assert (await api.get("/v1/infer/models")).status_code == 200
    assert (await api.get("/v1/infer/models")).status_code == 200
    await APIKey.objects.filter(prefix=api.key.split("_")[1]).aupdate(revoked_at=timezone.now())
    assert_invalid_key(await api.get("/v1/infer/models"), api.key)


async def test_deactivating_the_organization_takes_effect_at_once(api: API) -> None:
    assert (await api.get("/v1/infer/models")).status_code == 200
    org = await Organization.objects.aget(slug="acme")
    org.active = False
    await org.asave()
    assert_invalid_key(await api.get("/v1/infer/models"), api.key)
