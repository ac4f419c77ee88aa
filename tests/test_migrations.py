"""The migrations: they match the models, and they apply on an empty database and unapply back to it."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection

pytestmark = pytest.mark.database

APPS = ("orgs", "inference", "agents")


@pytest.mark.django_db
def test_the_models_need_no_new_migration() -> None:
    output = StringIO()

    call_command("makemigrations", "--check", "--dry-run", stdout=output, stderr=output)


@pytest.mark.django_db(transaction=True)
def test_every_migration_unapplies_and_applies_again() -> None:
    for app in APPS:
        call_command("migrate", app, "zero", verbosity=0)
    left = {table for table in connection.introspection.table_names() if table.startswith(tuple(f"{a}_" for a in APPS))}

    call_command("migrate", verbosity=0)

    assert left == set()
    assert {"orgs_apikey", "inference_usagerecord", "agents_storedresponse"} <= set(
        connection.introspection.table_names()
    )
