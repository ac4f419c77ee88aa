from __future__ import annotations

import re
import subprocess
import sys
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from core import redis as redis_clients
from inference.models import CatalogEntry
from orgs.models import APIKey, Limit, Organization
from orgs.services import InvalidAPIKey, authenticate_key
from tests.conftest import MODEL_ID, ROOT
from tests.services import free_port

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.database]


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


@pytest.mark.parametrize("command", ["create_org", "create_key", "revoke_key", "set_limit", "serve", "bootstrap_demo"])
def test_each_command_explains_itself_with_help(command: str) -> None:
    result = subprocess.run([sys.executable, "manage.py", command, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0
    assert "usage:" in result.stdout


def test_create_org_creates_once_and_prints_the_slug() -> None:
    assert run("create_org", "globex", "--name", "Globex Corp").strip() == "globex"
    assert run("create_org", "globex").strip() == "globex"
    org = Organization.objects.get(slug="globex")
    assert org.name == "Globex Corp" and org.active


def test_create_org_refuses_an_invalid_slug() -> None:
    with pytest.raises(CommandError):
        run("create_org", "Not A Slug")


def test_create_key_prints_a_working_key_alone() -> None:
    run("create_org", "globex")
    output = run("create_key", "globex", "--name", "ci")
    assert output.endswith("\n") and output.count("\n") == 1
    key = authenticate_key(raw_key=output.strip())
    assert key.name == "ci" and key.organization.slug == "globex"
    assert APIKey.objects.count() == 1


@pytest.mark.parametrize("given", ["whole", "as the admin lists it"])
def test_revoke_key_revokes_a_key_given_whole_or_as_listed_and_it_is_refused_at_once(given: str) -> None:
    run("create_org", "globex")
    raw = run("create_key", "globex", "--name", "ci").strip()
    other = run("create_key", "globex", "--name", "other").strip()
    key = authenticate_key(raw_key=raw)

    said = run("revoke_key", raw if given == "whole" else key.display_prefix)

    assert said.strip() == f"Revoked {key.display_prefix} (ci) of 'globex'."
    with pytest.raises(InvalidAPIKey):
        authenticate_key(raw_key=raw)
    assert authenticate_key(raw_key=other).name == "other"
    assert "was revoked already" in run("revoke_key", raw)


def test_revoke_key_with_redis_away_revokes_and_warns_when_the_other_processes_see_it(
    settings: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings.REDIS_URL, settings.DISTRIBUTED = f"redis://127.0.0.1:{free_port()}/0", True  # nothing listens there
    monkeypatch.setattr(redis_clients, "_sync_client", None)
    key, raw = APIKey.generate(organization=Organization.objects.create(slug="acme", name="Acme"), name="k")
    caplog.clear()

    said = run("revoke_key", raw)

    assert said.startswith("Revoked b3os_")
    assert APIKey.objects.get(pk=key.pk).revoked_at is not None
    (warned,) = [record for record in caplog.records if record.name == "orgs.keycache"]
    assert warned.levelname == "WARNING" and warned.exc_info is None
    assert "they see it within API_KEY_CACHE_SECONDS" in warned.getMessage()


@pytest.mark.parametrize("given", ["b3os_abc", "not-a-key", "b3os_ABCDEFGHIJ_…"])
def test_revoke_key_refuses_what_names_no_key(given: str) -> None:
    with pytest.raises(CommandError, match="Give the key whole|No key"):
        run("revoke_key", given)


def test_create_key_refuses_an_unknown_organization() -> None:
    with pytest.raises(CommandError, match="No organization"):
        run("create_key", "nobody")


def test_set_limit_sets_the_default_and_a_per_model_override(catalog_model: CatalogEntry) -> None:
    run("create_org", "globex")
    run("set_limit", "globex", "--tpm", "1000", "--rpm", "10", "--in-flight", "2")
    run("set_limit", "globex", MODEL_ID, "--rpm", "5")
    default = Limit.objects.get(organization__slug="globex", model__isnull=True)
    override = Limit.objects.get(organization__slug="globex", model=catalog_model)
    assert (default.tokens_per_minute, default.requests_per_minute, default.requests_in_flight) == (1000, 10, 2)
    assert (override.tokens_per_minute, override.requests_per_minute, override.requests_in_flight) == (None, 5, None)
    run("set_limit", "globex", "--rpm", "20")
    assert Limit.objects.filter(organization__slug="globex").count() == 2
    assert Limit.objects.get(organization__slug="globex", model__isnull=True).requests_per_minute == 20


def test_set_limit_with_no_limit_shows_the_row_and_with_remove_deletes_it(catalog_model: CatalogEntry) -> None:
    run("create_org", "globex")
    run("set_limit", "globex", "--rpm", "10")
    run("set_limit", "globex", MODEL_ID, "--rpm", "5")

    assert run("set_limit", "globex").strip().endswith("tpm=unlimited rpm=10 in_flight=unlimited")
    assert Limit.objects.get(organization__slug="globex", model__isnull=True).requests_per_minute == 10
    assert run("set_limit", "globex", MODEL_ID, "--remove").strip() == f"Removed the row for {MODEL_ID} of globex."
    assert run("set_limit", "globex", MODEL_ID).strip() == f"No row for {MODEL_ID}: the default row of globex applies."
    assert not Limit.objects.filter(organization__slug="globex", model=catalog_model).exists()


def test_set_limit_warns_that_a_models_row_with_no_limit_leaves_it_unlimited(catalog_model: CatalogEntry) -> None:
    run("create_org", "globex")
    warned = StringIO()

    call_command("set_limit", "globex", MODEL_ID, "--rpm", "none", stdout=StringIO(), stderr=warned)

    assert f"leaves {MODEL_ID} unlimited for globex, whatever its default row says" in warned.getvalue()
    assert f"set_limit globex {MODEL_ID} --remove" in warned.getvalue()


def test_set_limit_refuses_an_unknown_model() -> None:
    run("create_org", "globex")
    with pytest.raises(CommandError, match="No catalog model"):
        run("set_limit", "globex", "nobody/model", "--rpm", "1")


TOO_LONG = "Ensure this value has at most 200 characters (it has 201)."


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["create_org", "a" * 65], "slug: Ensure this value has at most 64 characters (it has 65)."),
        (["create_org", "globex", "--name", "G" * 201], f"name: {TOO_LONG}"),
        (["create_key", "acme", "--name", "k" * 201], f"name: {TOO_LONG}"),
        (["set_limit", "acme", "--tpm", str(10**19)], "tokens_per_minute: Ensure this value is less than or equal to"),
    ],
    ids=["long slug", "long name", "long key name", "huge limit"],
)
def test_the_commands_refuse_what_the_admins_forms_refuse_and_write_nothing(args: list[str], message: str) -> None:
    Organization.objects.create(slug="acme", name="Acme")

    with pytest.raises(CommandError, match=re.escape(message)):
        run(*args)

    assert list(Organization.objects.values_list("slug", flat=True)) == ["acme"]
    assert not APIKey.objects.exists() and not Limit.objects.exists()


def test_create_key_warns_that_an_inactive_organizations_key_is_refused() -> None:
    Organization.objects.create(slug="acme", name="Acme", active=False)
    out, err = StringIO(), StringIO()

    call_command("create_key", "acme", stdout=out, stderr=err)

    assert out.getvalue().startswith("b3os_")
    assert "'acme' is inactive: its keys are refused until it is made active." in err.getvalue()
