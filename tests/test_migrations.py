"""The migrations: they match the models, and they apply on an empty database and unapply back to it."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from inference.models import UsageDailyRollup, UsageRecord

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


@pytest.mark.django_db(transaction=True)
def test_usage_records_of_server_tool_runs_are_taken_out_of_the_usage_they_were_counted_in() -> None:
    before, after = (
        ("inference", "0009_catalog_token_limits_at_least_one"),
        ("inference", "0010_usage_without_tool_runs"),
    )
    executor = MigrationExecutor(connection)
    executor.migrate([before])
    apps = executor.loader.project_state([before]).apps
    organization = apps.get_model("orgs", "Organization").objects.create(slug="acme", name="Acme")
    records, rollups = apps.get_model("inference", "UsageRecord"), apps.get_model("inference", "UsageDailyRollup")
    for model, endpoint in [("b3os/model-a", "agents.responses"), ("knowledge_search", "agents.tools")]:
        common = {"organization": organization, "model": model, "endpoint": endpoint}
        records.objects.create(**common, status=200, request_id="req_1", created=timezone.now())
        rollups.objects.create(**common, day=timezone.now().date(), requests=1)

    executor = MigrationExecutor(connection)
    executor.migrate([after])

    assert list(UsageRecord.objects.values_list("model", "endpoint")) == [("b3os/model-a", "agents.responses")]
    assert list(UsageDailyRollup.objects.values_list("model", "endpoint")) == [("b3os/model-a", "agents.responses")]
