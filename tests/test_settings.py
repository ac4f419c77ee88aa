"""Settings read from the environment, and the system checks that refuse what cannot work: each case in a fresh
process, as a deployment would start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

SHOW = (
    "import json; from config import settings as s; print(json.dumps({name: "
    "getattr(s, name, None) for name in ('SECURE_PROXY_SSL_HEADER', 'CSRF_TRUSTED_ORIGINS', 'SESSION_COOKIE_SECURE', "
    "'CSRF_COOKIE_SECURE', 'SECURE_HSTS_SECONDS', 'SECURE_HSTS_INCLUDE_SUBDOMAINS')}))"
)


# The checks of the environment's settings (tagged compatibility), without the URL and admin checks' imports.
CHECK = ["manage.py", "check", "--tag", "compatibility"]


def run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG", "REDIS_URL")}
    environment.update({"B3OS_VAR_DIR": str(tmp_path), "DJANGO_SETTINGS_MODULE": "config.settings", "DATABASE_URL": ""})
    environment.update(env)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120
    )


def settings_with(tmp_path: Path, **env: str) -> dict[str, Any]:
    result = run(["-c", SHOW], tmp_path, **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_behind_a_tls_proxy_the_forwarded_scheme_and_the_trusted_origins_come_from_the_environment(
    tmp_path: Path,
) -> None:
    found = settings_with(
        tmp_path,
        SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto",
        CSRF_TRUSTED_ORIGINS="https://infer.example.com,https://admin.example.com",
        SECURE_HSTS_INCLUDE_SUBDOMAINS="true",
    )

    assert found["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert found["CSRF_TRUSTED_ORIGINS"] == ["https://infer.example.com", "https://admin.example.com"]
    assert found["SECURE_HSTS_INCLUDE_SUBDOMAINS"] is True
    assert settings_with(tmp_path, SECURE_PROXY_SSL_HEADER="X-Scheme: secure")["SECURE_PROXY_SSL_HEADER"] == [
        "HTTP_X_SCHEME",
        "secure",
    ]


def test_cookies_are_secure_and_hsts_is_on_unless_debug_is(tmp_path: Path) -> None:
    production = settings_with(tmp_path)
    debugging = settings_with(tmp_path, DEBUG="true")
    plain_http = settings_with(tmp_path, SESSION_COOKIE_SECURE="false", CSRF_COOKIE_SECURE="false")

    assert (production["SESSION_COOKIE_SECURE"], production["CSRF_COOKIE_SECURE"]) == (True, True)
    assert production["SECURE_HSTS_SECONDS"] == 365 * 24 * 3600
    assert (debugging["SESSION_COOKIE_SECURE"], debugging["CSRF_COOKIE_SECURE"], debugging["SECURE_HSTS_SECONDS"]) == (
        False,
        False,
        0,
    )
    assert (plain_http["SESSION_COOKIE_SECURE"], plain_http["CSRF_COOKIE_SECURE"]) == (False, False)


def test_a_proxy_header_that_is_not_a_header_name_is_refused_by_the_checks(tmp_path: Path) -> None:
    result = run(CHECK, tmp_path, SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto=https")

    assert result.returncode != 0
    assert "config.E006" in result.stderr and "SECURE_PROXY_SSL_HEADER" in result.stderr


def test_running_distributed_without_a_shared_secret_key_is_an_error(tmp_path: Path) -> None:
    unshared = run(CHECK, tmp_path, REDIS_URL="redis://127.0.0.1:1/0")
    shared = run(CHECK, tmp_path, REDIS_URL="redis://127.0.0.1:1/0", SECRET_KEY="one-for-all")

    assert unshared.returncode != 0 and "config.E012" in unshared.stderr
    assert shared.returncode == 0, shared.stderr


@pytest.mark.parametrize("url", ["mysql://user@host/db", "oracle://user@host/db", "not a url"])
def test_a_database_url_this_project_cannot_run_on_is_named_by_the_checks(tmp_path: Path, url: str) -> None:
    # A backend Django knows but this project does not ship a driver for failed with an ImportError's traceback.
    result = run(CHECK, tmp_path, DATABASE_URL=url)

    assert result.returncode != 0 and "config.E004" in result.stderr and "Traceback" not in result.stderr


def test_a_log_level_is_read_in_any_case_and_one_that_is_none_is_named_by_the_checks(tmp_path: Path) -> None:
    lower = run(CHECK, tmp_path, LOG_LEVEL="debug")
    wrong = run(CHECK, tmp_path, LOG_LEVEL="verbose")

    assert lower.returncode == 0, lower.stderr
    assert wrong.returncode != 0 and "config.E050" in wrong.stderr and "Traceback" not in wrong.stderr


def test_cpu_runner_threads_that_are_no_count_of_threads_are_named_by_the_checks(tmp_path: Path) -> None:
    for threads in ("two", "0"):
        result = run(CHECK, tmp_path, CPU_RUNNER_THREADS=threads)

        assert result.returncode != 0 and "CPU_RUNNER_THREADS" in result.stderr, result.stderr


def test_a_duration_or_a_bound_of_zero_or_less_is_named_by_the_checks(tmp_path: Path) -> None:
    wrong = {"STREAM_MAX_SECONDS": "-5", "USAGE_ROLLUP_INTERVAL_SECONDS": "0", "MAX_JSON_DEPTH": "0"}

    result = run(CHECK, tmp_path, **wrong)

    assert result.returncode != 0 and result.stderr.count("config.E052") == len(wrong), result.stderr
    assert all(f"{name}={value} is" in result.stderr for name, value in wrong.items())


def test_processes_starting_at_once_without_a_secret_key_generate_one_and_all_use_it(tmp_path: Path) -> None:
    environment = {k: v for k, v in os.environ.items() if k != "SECRET_KEY"}
    environment.update(B3OS_VAR_DIR=str(tmp_path), DATABASE_URL="")
    show = "from config import settings; print(settings.SECRET_KEY)"
    starting = [
        subprocess.Popen([sys.executable, "-c", show], cwd=ROOT, env=environment, stdout=subprocess.PIPE, text=True)
        for _ in range(6)
    ]
    keys = {process.communicate(timeout=120)[0].strip() for process in starting}

    (key,) = keys
    assert len(key) > 50 and (tmp_path / "secret_key").read_text() == key
    assert (tmp_path / "secret_key").stat().st_mode & 0o777 == 0o600
    assert sorted(path.name for path in tmp_path.iterdir()) == ["b3os.sqlite3", "secret_key"]  # no key half-written


def test_the_sqlite_database_is_made_and_kept_readable_by_its_owner_only(tmp_path: Path) -> None:
    # It holds sessions and upstream keys; it was made readable by every user of the host.
    old = tmp_path / "old"
    old.mkdir()
    (old / "b3os.sqlite3").touch(mode=0o644)
    (old / "b3os.sqlite3").chmod(0o644)

    for var_dir in (tmp_path, old):
        assert run(CHECK, var_dir).returncode == 0

    assert (tmp_path / "b3os.sqlite3").stat().st_mode & 0o777 == 0o600
    assert (old / "b3os.sqlite3").stat().st_mode & 0o777 == 0o600


def test_the_example_secret_key_is_refused_by_the_checks(tmp_path: Path) -> None:
    result = run(CHECK, tmp_path, SECRET_KEY="change-me-to-one-long-random-string")

    assert result.returncode != 0 and "config.E013" in result.stderr


@pytest.mark.parametrize(
    ("env", "code"),
    [
        ({"GATEWAY_BASE_URL": "notaurl"}, "config.E041"),
        ({"GATEWAY_BASE_URL": "ftp://upstream.example/v1"}, "config.E041"),
        ({"GATEWAY_BASE_URL": "https://user:pw@upstream.example/v1"}, "config.E041"),
        ({"GATEWAY_BASE_URL": "https://upstream.example/v1?api-version=1"}, "config.E041"),
        ({"ALLOWED_HOSTS": ""}, "config.E007"),
        ({"ALLOWED_HOSTS": " , "}, "config.E007"),
    ],
)
def test_a_gateway_url_that_is_no_http_url_and_hosts_that_name_none_are_named_by_the_checks(
    tmp_path: Path, env: dict[str, str], code: str
) -> None:
    result = run(CHECK, tmp_path, **env)

    assert result.returncode != 0 and code in result.stderr and "Traceback" not in result.stderr


def test_an_http_gateway_url_passes_the_checks(tmp_path: Path) -> None:
    result = run(CHECK, tmp_path, GATEWAY_BASE_URL="http://127.0.0.1:9000/v1")

    assert result.returncode == 0, result.stderr
