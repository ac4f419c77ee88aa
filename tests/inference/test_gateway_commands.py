from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from inference.models import GATEWAY, CatalogEntry

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_add_gateway_model_offers_several_models_at_once_and_prints_each() -> None:
    assert run("add_gateway_model", "openai/gpt-4o", "openai/gpt-4o-mini", "--allow", "n").split() == [
        "openai/gpt-4o",
        "openai/gpt-4o-mini",
    ]

    entries = CatalogEntry.objects.filter(runner=GATEWAY).order_by("public_id")
    assert [(entry.public_id, entry.gateway_parameters) for entry in entries] == [
        ("openai/gpt-4o", ["n"]),
        ("openai/gpt-4o-mini", ["n"]),
    ]


def test_add_gateway_model_saves_none_of_the_models_when_one_is_refused() -> None:
    with pytest.raises(CommandError, match="not a model"):
        run("add_gateway_model", "openai/gpt-4o", "not a model")

    assert not CatalogEntry.objects.filter(runner=GATEWAY).exists()


def test_add_gateway_model_takes_an_upstream_id_for_one_model_only() -> None:
    with pytest.raises(CommandError, match="one model"):
        run("add_gateway_model", "a/one", "a/two", "--upstream-model", "gpt-4o")

    assert not CatalogEntry.objects.filter(runner=GATEWAY).exists()
