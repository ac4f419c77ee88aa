"""The suite on PostgreSQL, production's database: ``pytest -p tests.postgres -m database``.

Loaded as a plugin, this starts a throwaway cluster (``tests.services.Postgres``) and points ``DATABASE_URL`` at it
before pytest-django reads the settings, so the tests marked ``database`` (migrations, admission with limits, usage
writing and reports, the admin, stored agent conversations) run on PostgreSQL as they do on SQLite; pytest-django
creates its test database in the cluster. ``make test`` runs the suite on SQLite, then this. Tests that start servers
of their own still give them SQLite files (``tests.conftest.start_server``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from tests.services import MissingProgram, Postgres

_cluster: Postgres | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    # Before pytest-django's own hook of this name, which imports the settings and with them DATABASE_URL.
    global _cluster
    try:
        _cluster = Postgres().start()
    except MissingProgram as exc:
        raise pytest.UsageError(str(exc)) from None
    os.environ["DATABASE_URL"] = _cluster.url


@pytest.fixture(scope="session", autouse=True)
def _end_other_sessions(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """The async views' worker threads and the usage writer keep connections open: they are ended before the test
    database is dropped, which PostgreSQL refuses while anyone is connected."""
    yield
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


def pytest_report_header(config: pytest.Config) -> str:
    return f"database: a throwaway PostgreSQL cluster at {_cluster.url if _cluster else '?'}"


def pytest_unconfigure(config: pytest.Config) -> None:
    if _cluster is not None:
        _cluster.destroy()
