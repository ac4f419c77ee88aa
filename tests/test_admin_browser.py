"""The admin in a real headless chromium, against a live server: keys shown once, revoked at once, and the
usage report with its charts and CSV export."""

from __future__ import annotations

import csv
import io
import shutil
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from django.contrib.auth.hashers import make_password
from playwright.sync_api import Browser, Page, expect, sync_playwright

from inference.reporting.views import CSV_COLUMNS
from tests.conftest import MODEL_ID, LiveServer, manage, start_server, stop_server

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
ADMIN_USER, ADMIN_PASSWORD = "root", "a-long-admin-password"
CLERK_USER, CLERK_PASSWORD = "clerk", "a-long-clerk-password"
SCREENSHOTS = Path("/tmp/b3os-admin-screenshots")
PAST_DAYS = 5  # days before today with usage, rolled up; today has one real request


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(tmp_path_factory.mktemp("admin-browser"), org="live")
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:  # each manage.py takes seconds to start
            superuser = pool.submit(
                manage, "createsuperuser", "--noinput", "--username", ADMIN_USER, "--email", "root@example.com",
                env={**live.env, "DJANGO_SUPERUSER_PASSWORD": ADMIN_PASSWORD},
            )  # fmt: skip
            add_user(live, CLERK_USER, CLERK_PASSWORD)
            add_usage(live, pool)
            superuser.result()
        yield live
    finally:
        stop_server(live)


def add_user(live: LiveServer, username: str, password: str) -> None:
    """A user who is not staff, straight into the server's database."""
    live.query(
        "INSERT INTO auth_user (password, is_superuser, username, first_name, last_name, email, is_staff, is_active, "
        "date_joined) VALUES (?, 0, ?, '', '', '', 0, 1, ?)",
        make_password(password), username, datetime.now(UTC).isoformat(sep=" "),
    )  # fmt: skip


def add_usage(live: LiveServer, pool: ThreadPoolExecutor) -> None:
    """Past days' usage written straight into the server's database and rolled up by ``manage.py
    rollup_usage``; today's from a real request."""
    [(org_id,)] = live.query("SELECT id FROM orgs_organization WHERE slug = ?", live.org)
    [(key_id,)] = live.query("SELECT id FROM orgs_apikey WHERE organization_id = ?", org_id)
    now = datetime.now(UTC)
    insert = (
        "INSERT INTO inference_usagerecord (organization_id, api_key_id, model, endpoint, route, status, error_code, "
        "input_tokens, output_tokens, reasoning_tokens, cached_tokens, time_to_first_token_ms, total_ms, request_id, "
        "created) VALUES (" + ", ".join("?" * 15) + ")"
    )
    seeded = 0
    for n in range(1, PAST_DAYS + 1):
        day = (now - timedelta(days=n)).replace(hour=12, minute=0, second=0, microsecond=0)
        for i in range(4 + n):
            failed = i == 0 and n % 2 == 1
            status, code = (429, "rate_limited") if failed else (200, "")
            live.query(
                insert, org_id, key_id, MODEL_ID, "chat.completions", "node", status, code, 0 if failed else 40 + i,
                0 if failed else 10 + n, 0, 0, None if failed else 30 + 10 * i, 100 * (i + 1), f"req_seed{n}x{i}",
                day.isoformat(sep=" "),
            )  # fmt: skip
            seeded += 1
    rollup = pool.submit(live.manage, "rollup_usage")
    response = httpx.post(
        f"{live.base_url}/chat/completions",
        headers={"Authorization": f"Bearer {live.key}"},
        json={"model": MODEL_ID, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert f"Rolled up {PAST_DAYS} day(s)" in rollup.result()
    deadline = time.monotonic() + 10  # the usage writer is a moment behind the responses
    while live.query("SELECT COUNT(*) FROM inference_usagerecord")[0][0] < seeded + 1:
        assert time.monotonic() < deadline, "the requests left no usage records"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"chromium is not installed at {CHROMIUM}: `make test` installs it")
    # Playwright gives every launch a fresh, temporary profile.
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
            ],
        )  # fmt: skip
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1366, "height": 860}, accept_downloads=True)
    context.set_default_timeout(15_000)
    yield context.new_page()
    context.close()


def log_in(page: Page, server: LiveServer, username: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> None:
    page.goto(f"{server.url}/admin/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    page.wait_for_load_state()


def models_status(server: LiveServer, key: str) -> int:
    return httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code


def test_a_visitor_who_is_not_staff_is_sent_to_the_login_page(page: Page, server: LiveServer) -> None:
    for path in ("/admin/", "/admin/orgs/apikey/", "/admin/usage/report/"):
        page.goto(server.url + path)
        assert page.url == f"{server.url}/admin/login/?next={path}"
        expect(page.locator("#id_username")).to_be_visible()

    log_in(page, server, CLERK_USER, CLERK_PASSWORD)  # a user, but not staff
    expect(page.locator(".errornote")).to_contain_text("staff account")
    page.goto(server.url + "/admin/usage/report/")
    assert page.url == f"{server.url}/admin/login/?next=/admin/usage/report/"


def test_an_admin_creates_an_organization_and_a_key_that_works_until_revoked(page: Page, server: LiveServer) -> None:
    slug = f"browser-{uuid.uuid4().hex[:6]}"
    log_in(page, server)

    page.goto(f"{server.url}/admin/orgs/organization/add/")
    page.locator("#id_name").press_sequentially(slug.replace("-", " ").title())
    expect(page.locator("#id_slug")).to_have_value(slug)  # filled in from the name by the admin's script
    page.click("input[name=_save]")
    expect(page.locator(".messagelist .success")).to_contain_text("was added successfully")

    page.locator("#result_list tr", has_text=slug).get_by_role("link", name="Create key").click()
    assert page.locator("#id_organization option:checked").inner_text() == slug
    page.fill("#id_name", "from the browser")
    page.click("input[name=_save]")
    secret = page.locator("#new-api-key").inner_text()
    assert secret.startswith("b3os_") and len(secret) > 40
    SCREENSHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "key-created.png"), full_page=True)

    page.click("#keys-link")
    page.locator("#result_list tr", has_text=slug).locator("th a").click()
    expect(page.locator("h1")).to_contain_text("Change API key")
    assert page.locator("#new-api-key").count() == 0
    assert secret not in page.content()
    assert secret[:15] in page.content()  # the prefix identifies the key
    page.screenshot(path=str(SCREENSHOTS / "key-page.png"), full_page=True)
    page.reload()
    assert secret not in page.content()

    assert models_status(server, secret) == 200

    page.goto(f"{server.url}/admin/orgs/apikey/?q={slug}")
    page.locator("#result_list tr", has_text=slug).locator("input.action-select").check()
    page.select_option("select[name=action]", "revoke_keys")
    page.click("button[name=index]")
    expect(page.locator(".messagelist .success")).to_contain_text("Revoked 1 key(s).")

    assert models_status(server, secret) == 401


def test_the_usage_report_shows_charts_and_exports_what_it_shows_as_csv(page: Page, server: LiveServer) -> None:
    log_in(page, server)
    page.get_by_role("link", name="Usage report").first.click()
    expect(page.locator("h1")).to_have_text("Usage report")
    page.select_option("#id_organization", server.org)
    page.click("input[value=Apply]")
    assert f"organization={server.org}" in page.url

    total_requests = int(page.locator("#total-requests").inner_text().replace(",", ""))
    seeded = sum(4 + n for n in range(1, PAST_DAYS + 1))
    assert total_requests == seeded + 1

    bars = page.locator("#chart-requests svg rect.point")
    assert bars.count() == 14 * 2  # a bar per day for successes and for failures
    drawn = [(bar.get_attribute("data-label"), float(bar.get_attribute("data-value"))) for bar in bars.all()]
    assert sum(value for _, value in drawn) == total_requests
    assert len({label for label, value in drawn if value}) == PAST_DAYS + 1
    assert all(bar.bounding_box()["height"] > 0 for bar in bars.all() if float(bar.get_attribute("data-value")))
    assert page.locator("#chart-tokens svg rect.point[data-series=output_tokens]").count() == 14
    assert page.locator("#chart-latency svg circle.point[data-series=latency_p95]").count() == PAST_DAYS + 1
    expect(page.locator("#errors-by-code")).to_contain_text("rate_limited")
    expect(page.locator("#top-organizations")).to_contain_text(server.org)
    expect(page.locator("#top-models")).to_contain_text(MODEL_ID)
    SCREENSHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "usage-report.png"), full_page=True)

    with page.expect_download() as download_info:
        page.click("#download-csv")
    download = download_info.value
    assert download.suggested_filename.startswith("usage-") and download.suggested_filename.endswith(".csv")
    rows = list(csv.reader(io.StringIO(Path(download.path()).read_text())))
    assert rows[0] == CSV_COLUMNS
    table = [dict(zip(CSV_COLUMNS, row, strict=True)) for row in rows[1:]]
    assert [(r["name"], int(r["requests"])) for r in table if r["section"] == "total"] == [("all", total_requests)]
    per_day = {r["name"]: int(r["requests"]) for r in table if r["section"] == "day"}
    charted: dict[str, float] = {}
    for label, value in drawn:
        charted[label] = charted.get(label, 0) + value
    assert per_day == charted and len(per_day) == 14
    assert [r["name"] for r in table if r["section"] == "organization"] == [server.org]
    assert [r["name"] for r in table if r["section"] == "error_code"] == ["rate_limited"]


def chat_status(server: LiveServer, key: str) -> int:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.base_url}/chat/completions", headers=headers, json=body, timeout=120).status_code


def test_an_admin_sets_an_organizations_limits_on_its_page_and_the_next_request_obeys_them(
    page: Page, server: LiveServer
) -> None:
    slug = f"limited-{uuid.uuid4().hex[:6]}"
    log_in(page, server)
    page.goto(f"{server.url}/admin/orgs/organization/add/")
    page.locator("#id_name").press_sequentially(slug.replace("-", " ").title())
    for row in range(2):  # a careless admin: two defaults
        page.locator("#limits-group .add-row a").click()
        page.fill(f"input[name=limits-{row}-requests_per_minute]", "0")
    page.click("input[name=_save]")

    expect(page.locator(".errornote")).to_be_visible()
    expect(page.locator("#limits-group .errorlist.nonform")).to_have_text(
        "An organization has one default limit (model left blank): keep one of these rows."
    )
    assert server.query("SELECT COUNT(*) FROM orgs_organization WHERE slug = ?", slug) == [(0,)]

    page.locator("#limits-group tr.dynamic-limits").nth(1).locator(".inline-deletelink").click()
    page.click("input[name=_save]")
    expect(page.locator(".messagelist .success")).to_contain_text("was added successfully")
    key = server.manage("create_key", slug).strip()
    assert chat_status(server, key) == 429  # no request per minute

    page.locator("#result_list th a", has_text=slug).click()
    page.fill("input[name=limits-0-requests_per_minute]", "5")
    page.click("input[name=_save]")
    expect(page.locator(".messagelist .success")).to_contain_text("was changed successfully")
    assert chat_status(server, key) == 200  # at once, not once the old limit has aged out of a cache
