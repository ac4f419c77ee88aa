"""The organizations' admin as a careless or hostile admin uses it: what its forms refuse, and how they say so."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.utils import timezone

from inference.models import CatalogEntry, UsageRecord
from orgs import admission
from orgs.models import APIKey, Limit, Organization
from orgs.services import create_organization
from tests.conftest import API, MODEL_ID

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.database]


@pytest.fixture
def staff_client() -> Client:
    user = get_user_model().objects.create_superuser("root", "root@example.com", "a-long-password")
    client = Client(raise_request_exception=False)
    client.force_login(user)
    return client


def organization_form(
    organization: Organization, limits: Sequence[CatalogEntry | None], *, shown: Sequence[Limit] = ()
) -> dict[str, str]:
    """The organization's page as posted: ``shown`` are its saved limit rows on the page, ``limits`` new rows."""
    data = {
        "name": organization.name,
        "slug": organization.slug,
        "active": "on",
        "limits-TOTAL_FORMS": str(len(shown) + len(limits)),
        "limits-INITIAL_FORMS": str(len(shown)),
        "api_keys-TOTAL_FORMS": "0",
        "api_keys-INITIAL_FORMS": "0",
    }
    rows = [(row.pk, row.model) for row in shown] + [(None, model) for model in limits]
    for index, (pk, model) in enumerate(rows):
        data[f"limits-{index}-id"] = str(pk or "")
        data[f"limits-{index}-organization"] = str(organization.pk or "")
        data[f"limits-{index}-model"] = str(model.pk) if model else ""
        data[f"limits-{index}-requests_per_minute"] = "10"
    return data


def errors(page: bytes) -> str:
    return " ".join(
        re.sub(r"<[^>]+>", " ", found)
        for found in re.findall(r'class="errorlist[^"]*"[^>]*>(.*?)</ul>', page.decode(), re.S)
    )


def test_a_new_organization_with_two_default_limits_is_refused_by_the_form(staff_client: Client) -> None:
    page = staff_client.post(
        "/admin/orgs/organization/add/", organization_form(Organization(name="Globex", slug="globex"), [None, None])
    )

    assert page.status_code == 200
    assert "An organization has one default limit (model left blank): keep one of these rows." in errors(page.content)
    assert not Organization.objects.filter(slug="globex").exists()


def test_a_second_default_limit_beside_the_saved_one_is_refused_by_the_form(
    staff_client: Client, organization: Organization
) -> None:
    saved = Limit.objects.create(organization=organization, requests_per_minute=5)
    url = f"/admin/orgs/organization/{organization.pk}/change/"

    page = staff_client.post(url, organization_form(organization, [None], shown=[saved]))

    assert page.status_code == 200 and "one default limit" in errors(page.content)
    assert list(Limit.objects.values_list("requests_per_minute", flat=True)) == [5]


@pytest.mark.parametrize("scope", ["default", "model"])
def test_a_limit_for_a_scope_saved_meanwhile_is_refused_by_the_form_not_a_server_error(
    staff_client: Client, organization: Organization, catalog_model: CatalogEntry, scope: str
) -> None:
    """The page was opened before another admin saved a limit for the same scope."""
    model = catalog_model if scope == "model" else None
    Limit.objects.create(organization=organization, model=model, requests_per_minute=5)
    url = f"/admin/orgs/organization/{organization.pk}/change/"

    page = staff_client.post(url, organization_form(organization, [model]))

    assert page.status_code == 200
    expected = f"one limit per model: {MODEL_ID} is named twice" if model else "one default limit"
    assert expected in errors(page.content)
    assert Limit.objects.count() == 1


def test_a_default_limit_can_become_a_models_limit_while_a_new_default_is_added(
    staff_client: Client, organization: Organization, catalog_model: CatalogEntry
) -> None:
    saved = Limit.objects.create(organization=organization, requests_per_minute=5)
    data = organization_form(organization, [None], shown=[saved])
    data["limits-0-model"] = str(catalog_model.pk)

    response = staff_client.post(f"/admin/orgs/organization/{organization.pk}/change/", data)

    assert response.status_code == 302
    assert sorted(Limit.objects.values_list("model", flat=True), key=str) == [catalog_model.pk, None]


@pytest.mark.parametrize("how", ["onto-a-deleted-row", "a-swap"])
def test_rows_that_trade_models_in_one_save_are_saved_not_a_server_error(
    staff_client: Client, organization: Organization, catalog_model: CatalogEntry, how: str
) -> None:
    default = Limit.objects.create(organization=organization, requests_per_minute=5)
    models = Limit.objects.create(organization=organization, model=catalog_model, requests_per_minute=7)
    data = organization_form(organization, [], shown=[default, models])
    data["limits-0-requests_per_minute"], data["limits-1-requests_per_minute"] = "5", "7"
    data["limits-0-model"] = str(catalog_model.pk)  # the default row becomes the model's
    if how == "a-swap":
        data["limits-1-model"] = ""  # and the model's the default
    else:
        data["limits-1-DELETE"] = "on"

    response = staff_client.post(f"/admin/orgs/organization/{organization.pk}/change/", data)

    assert response.status_code == 302, errors(response.content)
    saved = {row.model_id: row.requests_per_minute for row in Limit.objects.filter(organization=organization)}
    assert saved == ({catalog_model.pk: 5, None: 7} if how == "a-swap" else {catalog_model.pk: 5})


def test_a_models_limit_row_with_no_limit_is_saved_with_a_warning_that_it_leaves_the_model_unlimited(
    staff_client: Client, organization: Organization, catalog_model: CatalogEntry
) -> None:
    data = organization_form(organization, [None, catalog_model])
    data["limits-1-requests_per_minute"] = ""

    page = staff_client.post(f"/admin/orgs/organization/{organization.pk}/change/", data, follow=True)

    assert f"The row for {MODEL_ID} has no limit: it leaves that model unlimited for acme" in html.unescape(
        page.content.decode()
    )
    assert Limit.objects.filter(organization=organization).count() == 2


def test_a_models_row_with_no_limit_added_on_the_limits_page_warns_as_the_organizations_page_does(
    staff_client: Client, organization: Organization, catalog_model: CatalogEntry
) -> None:
    Limit.objects.create(organization=organization, requests_per_minute=1)
    row = {"organization": organization.pk, "model": catalog_model.pk}

    page = staff_client.post("/admin/orgs/limit/add/", row, follow=True)

    assert f"The row for {MODEL_ID} has no limit: it leaves that model unlimited for acme" in html.unescape(
        page.content.decode()
    )
    assert Limit.objects.filter(organization=organization).count() == 2


def test_a_second_default_limit_on_the_limits_page_is_refused_with_a_message_an_admin_understands(
    staff_client: Client, organization: Organization
) -> None:
    Limit.objects.create(organization=organization, requests_per_minute=5)

    page = staff_client.post(
        "/admin/orgs/limit/add/",
        {"organization": organization.pk, "model": "", "tokens_per_minute": "100", "requests_per_minute": ""},
    )

    assert page.status_code == 200
    assert "This organization has a default limit already (model left blank): change that one instead." in errors(
        page.content
    )
    assert Limit.objects.count() == 1


async def test_a_limit_lowered_as_the_admin_saves_it_applies_to_the_next_request(api: API) -> None:
    organization = await Organization.objects.aget(slug="acme")
    row = await Limit.objects.acreate(organization=organization, requests_per_minute=10)
    admission.clear_limits_cache()
    ask = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert (await api.post("/v1/infer/chat/completions", ask)).status_code == 200

    row.requests_per_minute = 0
    await row.asave()

    assert (await api.post("/v1/infer/chat/completions", ask)).status_code == 429
    await row.adelete()
    assert (await api.post("/v1/infer/chat/completions", ask)).status_code == 200


def test_a_key_that_would_expire_before_it_is_created_is_refused(
    staff_client: Client, organization: Organization
) -> None:
    past = timezone.now() - timedelta(days=1)

    page = staff_client.post(
        "/admin/orgs/apikey/add/",
        {
            "organization": organization.pk,
            "name": "ci",
            "expires_at_0": past.date().isoformat(),
            "expires_at_1": past.time().strftime("%H:%M:%S"),
        },
    )

    assert page.status_code == 200 and 'id="new-api-key"' not in page.content.decode()
    assert "Choose a time in the future" in errors(page.content)
    assert not APIKey.objects.exists()


def test_a_saved_key_may_be_given_an_expiry_that_has_passed_to_end_it(
    staff_client: Client, organization: Organization
) -> None:
    key, _ = APIKey.generate(organization=organization, name="ci")
    past = timezone.now() - timedelta(minutes=1)

    response = staff_client.post(
        f"/admin/orgs/apikey/{key.pk}/change/",
        {"name": "ci", "expires_at_0": past.date().isoformat(), "expires_at_1": past.time().strftime("%H:%M:%S")},
    )

    assert response.status_code == 302
    key.refresh_from_db()
    assert key.state == "expired"


def test_an_organization_that_has_used_the_api_is_deactivated_not_deleted(
    staff_client: Client, organization: Organization
) -> None:
    UsageRecord.objects.create(
        organization=organization, model=MODEL_ID, endpoint="chat.completions", status=200, request_id="req_1",
        created=timezone.now(),
    )  # fmt: skip
    url = f"/admin/orgs/organization/{organization.pk}/"

    page = staff_client.get(url + "change/").content.decode()
    assert "deleting it would delete its usage records" in page and f"{url}delete/" not in page
    assert staff_client.get(url + "delete/").status_code == 403
    assert staff_client.post(url + "delete/", {"post": "yes"}).status_code == 403
    listing = staff_client.get("/admin/orgs/organization/").content.decode()
    assert "delete_selected" not in listing
    staff_client.post("/admin/orgs/organization/", {"action": "delete_selected", "_selected_action": organization.pk,
                                                    "post": "yes"})  # fmt: skip
    assert Organization.objects.filter(pk=organization.pk).exists() and UsageRecord.objects.count() == 1


@pytest.mark.parametrize("keys", [0, 2])
def test_an_organization_made_by_mistake_can_still_be_deleted_with_its_unused_keys(
    staff_client: Client, organization: Organization, keys: int
) -> None:
    for number in range(keys):
        APIKey.generate(organization=organization, name=f"key {number}")

    response = staff_client.post(f"/admin/orgs/organization/{organization.pk}/delete/", {"post": "yes"})

    assert response.status_code == 302 and not Organization.objects.exists() and not APIKey.objects.exists()


def test_a_key_that_was_used_is_revoked_not_deleted(staff_client: Client, organization: Organization) -> None:
    key, _ = APIKey.generate(organization=organization, name="used")
    UsageRecord.objects.create(
        organization=organization, api_key=key, model=MODEL_ID, endpoint="chat.completions", status=200,
        request_id="req_1", created=timezone.now(),
    )  # fmt: skip

    response = staff_client.post(f"/admin/orgs/apikey/{key.pk}/delete/", {"post": "yes"})

    assert response.status_code == 403 and APIKey.objects.filter(pk=key.pk).exists()


@pytest.mark.parametrize(
    "query", ["organization=abc", "organization=99999999999999999999999", "model=%00&organization=1.5"]
)
def test_the_limit_page_opened_with_a_choice_that_names_no_row_opens_with_nothing_chosen(
    staff_client: Client, organization: Organization, query: str
) -> None:
    page = staff_client.get(f"/admin/orgs/limit/add/?{query}")

    assert page.status_code == 200 and "selected>acme</option>" not in page.content.decode()


@pytest.mark.parametrize(
    ("query", "shown"),
    [
        ("expires_at=garbage", None),
        ("expires_at=2027-13-01+00:00", None),
        ("expires_at=9999-12-31T23:59:00-05:00", None),
        ("expires_at=2027-01-02+03:04", "2027-01-02"),
        ("expires_at=2027-01-02", "2027-01-02"),
    ],
    ids=["not-a-time", "a-13th-month", "past-the-calendar-in-utc", "a-time", "a-date"],
)
def test_the_key_page_opened_with_an_expiry_shows_it_when_it_is_a_time_and_nothing_when_not(
    staff_client: Client, query: str, shown: str | None
) -> None:
    page = staff_client.get(f"/admin/orgs/apikey/add/?{query}")

    assert page.status_code == 200
    field = re.search(r'<input[^>]*name="expires_at_0"[^>]*>', page.content.decode())
    assert field is not None and (f'value="{shown}"' in field[0] if shown else "value=" not in field[0])


def test_the_limit_page_opened_for_an_organization_and_a_model_opens_with_them_chosen(
    staff_client: Client, organization: Organization, catalog_model: CatalogEntry
) -> None:
    page = staff_client.get(f"/admin/orgs/limit/add/?organization={organization.pk}&model={catalog_model.pk}")

    assert page.status_code == 200
    assert re.search(r"<option value=\"\d+\" selected>acme</option>", page.content.decode())
    assert re.search(rf"<option value=\"\d+\" selected>{re.escape(MODEL_ID)}</option>", page.content.decode())


@pytest.mark.parametrize("active", [True, False])
def test_a_key_made_for_an_inactive_organization_is_shown_with_a_warning_that_it_is_refused(
    staff_client: Client, organization: Organization, active: bool
) -> None:
    Organization.objects.filter(pk=organization.pk).update(active=active)

    form = {"organization": organization.pk, "name": "ci", "expires_at_0": "", "expires_at_1": ""}

    page = staff_client.post("/admin/orgs/apikey/add/", form).content.decode()

    assert 'id="new-api-key"' in page
    warning = re.search(r'id="inactive-organization">([^<]+)</li>', page)
    assert (warning is None) is active
    if warning:
        assert " ".join(warning.group(1).split()) == (
            "acme is inactive: this key is refused until the organization is made active again."
        )


def test_the_key_form_sent_again_by_a_reload_makes_no_second_key_and_shows_the_first(
    staff_client: Client, organization: Organization
) -> None:
    add_page = staff_client.get("/admin/orgs/apikey/add/").content.decode()
    once = re.search(r'name="once" value="([^"]+)"', add_page).group(1)  # type: ignore[union-attr]
    form = {"organization": organization.pk, "name": "ci", "expires_at_0": "", "expires_at_1": "", "once": once}

    first = staff_client.post("/admin/orgs/apikey/add/", form)
    again = staff_client.post("/admin/orgs/apikey/add/", form, follow=True)

    (key,) = APIKey.objects.filter(organization=organization)
    assert 'id="new-api-key"' in first.content.decode()
    assert again.redirect_chain == [(f"/admin/orgs/apikey/{key.pk}/change/", 302)]
    page = again.content.decode()
    assert 'id="new-api-key"' not in page and "This form made its key already" in page
    another = staff_client.get("/admin/orgs/apikey/add/").content.decode()
    assert once not in another  # a new form makes a new key


@pytest.mark.parametrize(
    "changelist",
    [
        "/admin/orgs/apikey/?created__year=99999",
        "/admin/orgs/organization/?created__year=0",
        "/admin/orgs/limit/?updated__year=99999",
        "/admin/inference/catalogentry/?created__year=99999",
        "/admin/agents/storedresponse/?created__year=99999",
        "/admin/auth/user/?date_joined__year=99999",
    ],
)
def test_a_list_filtered_on_a_year_no_date_holds_is_refused_as_a_wrong_filter_not_a_server_error(
    staff_client: Client, changelist: str
) -> None:
    page = staff_client.get(changelist)

    assert page.status_code == 302 and page["Location"].endswith("?e=1")


@pytest.mark.parametrize(
    ("url", "chosen"),
    [
        ("/admin/orgs/limit/add/", {"organization": "abc"}),
        ("/admin/orgs/limit/add/", {"organization": "99999999999999999999999"}),
        ("/admin/orgs/limit/add/", {"model": "abc"}),
        ("/admin/orgs/limit/{limit}/change/", {"organization": "1.5"}),
        ("/admin/orgs/organization/add/", {"limits-0-model": "abc"}),
    ],
    ids=["organization", "huge organization", "model", "organization of a saved limit", "model of an inline row"],
)
def test_an_autocomplete_choice_that_is_no_id_is_refused_by_the_form_not_a_server_error(
    staff_client: Client, organization: Organization, catalog_model: CatalogEntry, url: str, chosen: dict[str, str]
) -> None:
    saved = Limit.objects.create(organization=organization, requests_per_minute=5)
    form = {"organization": str(organization.pk), "model": str(catalog_model.pk), "tokens_per_minute": "5"}
    if url.startswith("/admin/orgs/organization/"):
        form = organization_form(Organization(name="Globex", slug="globex"), [catalog_model])

    page = staff_client.post(url.format(limit=saved.pk), {**form, **chosen})

    assert page.status_code == 200
    assert "Select a valid choice. That choice is not one of the available choices." in errors(page.content)
    assert list(Limit.objects.all()) == [saved] and not Organization.objects.filter(slug="globex").exists()


@pytest.mark.parametrize("slug", ["Demo", "demo-", "_demo", "de--mo", "de mo", "démo"])
def test_a_slug_create_org_refuses_is_refused_by_the_admin_and_the_model_with_the_same_message(
    staff_client: Client, slug: str
) -> None:
    """The slug is the agent runtime's tenant id, compared exactly: ``Demo`` beside ``demo`` would be two tenants."""
    message = f"{slug!r} is not a valid slug: use lowercase letters, digits and hyphens."
    with pytest.raises(CommandError, match=re.escape(message)):
        call_command("create_org", slug, stdout=StringIO(), stderr=StringIO())
    with pytest.raises(ValidationError, match=re.escape(message)):
        create_organization(slug=slug)

    page = staff_client.post(
        "/admin/orgs/organization/add/", organization_form(Organization(name="Demo", slug=slug), [])
    )

    assert page.status_code == 200 and html.unescape(errors(page.content)).split() == message.split()
    assert not Organization.objects.exists()


@pytest.mark.parametrize("slug", ["demo", "demo-2", "de_mo"])
def test_a_slug_create_org_accepts_is_accepted_by_the_admin(staff_client: Client, slug: str) -> None:
    response = staff_client.post(
        "/admin/orgs/organization/add/", organization_form(Organization(name="Demo", slug=slug), [])
    )

    assert response.status_code == 302 and Organization.objects.get().slug == slug


# --- revoking keys, and what the key list says of them --------------------------------------------------------


def revoke(client: Client, key: APIKey) -> None:
    client.post("/admin/orgs/apikey/", {"action": "revoke_keys", "_selected_action": [key.pk]})


def test_revoking_keys_is_written_in_each_keys_history(staff_client: Client, api_key: str) -> None:
    key = APIKey.objects.get()
    revoke(staff_client, key)

    key.refresh_from_db()
    assert key.state == "revoked"
    entry = LogEntry.objects.get(object_id=str(key.pk))
    assert (entry.action_flag, entry.change_message) == (CHANGE, "Revoked.")


def test_a_staff_user_who_may_only_view_keys_cannot_revoke_them(api_key: str) -> None:
    viewer = get_user_model().objects.create_user("viewer", password="a-long-password", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_apikey"))
    client = Client(raise_request_exception=False)
    client.force_login(viewer)

    assert "revoke_keys" not in client.get("/admin/orgs/apikey/").content.decode()
    revoke(client, APIKey.objects.get())
    assert APIKey.objects.get().state == "active"


def test_a_key_of_an_inactive_organization_is_not_listed_as_active(
    staff_client: Client, organization: Organization, api_key: str
) -> None:
    organization.active = False
    organization.save()

    assert APIKey.objects.get().state == "organization inactive"
    assert "tests" not in staff_client.get("/admin/orgs/apikey/?state=active").content.decode()
    assert "tests" in staff_client.get("/admin/orgs/apikey/?state=organization-inactive").content.decode()


@pytest.mark.parametrize("pasted", ["whole", "as listed", "prefix only", "the start of its prefix"])
def test_a_key_is_found_by_searching_for_it_whole_or_as_the_key_list_shows_it(
    staff_client: Client, organization: Organization, pasted: str
) -> None:
    key, raw = APIKey.generate(organization=organization, name="found")
    APIKey.generate(organization=organization, name="other")
    term = {
        "whole": raw,
        "as listed": key.display_prefix,
        "prefix only": f"b3os_{key.prefix}",
        "the start of its prefix": f"b3os_{key.prefix[:6]}",
    }[pasted]

    listing = staff_client.get("/admin/orgs/apikey/", {"q": f" {term} "}).content.decode()

    assert "found (" in listing or ">found<" in listing
    assert ">other<" not in listing and "other (" not in listing
    assert "1 result" in listing


def test_a_whole_key_that_is_not_one_finds_nothing_though_its_prefix_is_a_keys(
    staff_client: Client, organization: Organization
) -> None:
    key, raw = APIKey.generate(organization=organization, name="found")

    listing = staff_client.get("/admin/orgs/apikey/", {"q": raw[:-1] + ("A" if raw[-1] != "A" else "B")})

    assert "0 results" in listing.content.decode()


def test_a_refused_admin_page_is_logged_on_one_line_without_a_traceback(
    staff_client: Client, organization: Organization, caplog: pytest.LogCaptureFixture
) -> None:
    UsageRecord.objects.create(
        organization=organization, model=MODEL_ID, endpoint="chat.completions", status=200, request_id="req_1",
        created=timezone.now(),
    )  # fmt: skip

    assert staff_client.get(f"/admin/orgs/organization/{organization.pk}/delete/").status_code == 403

    (refused,) = [record for record in caplog.records if record.name == "django.request"]
    assert refused.levelname == "WARNING" and "Forbidden" in refused.getMessage() and refused.exc_info is None


def test_the_admin_offers_no_view_site_link_to_a_root_that_answers_api_clients(staff_client: Client) -> None:
    page = staff_client.get("/admin/").content.decode()

    assert "View site" not in page
