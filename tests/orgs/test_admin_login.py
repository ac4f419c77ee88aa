"""The admin's login holds out against guessing: five wrong passwords for a user from one address lock that pair out
for a while, each failure is logged, and a password anyone would guess first is refused when it is set."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.test import Client

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.database]

LOGIN = "/admin/login/?next=/admin/"
PASSWORD = "a-long-and-unusual-passphrase"


@pytest.fixture(autouse=True)
def admin() -> None:
    get_user_model().objects.create_superuser("operator", "operator@example.com", PASSWORD)


def log_in(password: str, address: str = "192.0.2.10") -> int:
    return Client(REMOTE_ADDR=address).post(LOGIN, {"username": "operator", "password": password}).status_code


def test_the_right_password_logs_in() -> None:
    assert log_in(PASSWORD) == 302


def test_five_wrong_passwords_lock_the_user_out_from_that_address_even_with_the_right_one() -> None:
    assert [log_in(f"guess-{n}") for n in range(5)][:4] == [200] * 4

    assert log_in(PASSWORD) == 429
    assert log_in(PASSWORD, address="192.0.2.11") == 302  # from elsewhere, the user logs in


def test_a_forwarded_for_header_does_not_make_a_guesser_someone_else() -> None:
    for n in range(5):
        Client(REMOTE_ADDR="192.0.2.10", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}").post(
            LOGIN, {"username": "operator", "password": f"guess-{n}"}
        )

    assert log_in(PASSWORD) == 429


def test_behind_the_balancer_a_guesser_is_locked_out_by_the_address_it_appended_not_the_user_everywhere() -> None:
    def through_balancer(client: str, password: str, forged: str = "") -> int:
        forwarded = f"{forged}, {client}" if forged else client  # HAProxy appends what it was reached from
        browser = Client(REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR=forwarded)
        return browser.post(LOGIN, {"username": "operator", "password": password}).status_code

    for n in range(5):
        through_balancer("203.0.113.7", f"guess-{n}", forged=f"198.51.100.{n}")

    assert through_balancer("203.0.113.7", PASSWORD) == 429
    assert through_balancer("203.0.113.8", PASSWORD) == 302


def test_the_right_password_before_the_limit_clears_the_count() -> None:
    for n in range(4):
        log_in(f"guess-{n}")
    assert log_in(PASSWORD) == 302

    assert [log_in(f"again-{n}") for n in range(4)] == [200] * 4
    assert log_in(PASSWORD) == 302


def test_a_failed_login_is_logged_without_the_password_or_name_tried(caplog: pytest.LogCaptureFixture) -> None:
    log_in("hunter2-guess")

    failures = [r.getMessage() for r in caplog.records if "login failure" in r.getMessage()]
    assert len(failures) == 1 and "/admin/login/" in failures[0]
    # Nor the name: a name field may hold a password typed in the wrong box.
    assert not any("hunter2-guess" in r.getMessage() or "operator" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("password", ["password", "12345678901", "operator1", "short"])
def test_a_password_anyone_would_guess_first_is_refused(password: str) -> None:
    with pytest.raises(ValidationError):
        validate_password(password, user=get_user_model().objects.get(username="operator"))
