"""A catalog entry's sampling defaults apply to requests that leave sampling unset, as the model's authors
recommend; what a request sets wins; the admin accepts only sampling parameters in OpenAI's ranges."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError

from inference.engine.generation import GenerationRequest, prepare
from inference.models import CatalogEntry
from tests.conftest import API, MODEL_ID, manage

pytestmark = pytest.mark.django_db(transaction=True)

QUESTION = [{"role": "user", "content": "Name one river in Oregon."}]


async def test_a_request_without_sampling_takes_the_models_defaults(catalog_model: CatalogEntry) -> None:
    catalog_model.sampling_defaults = {"temperature": 0.2, "top_p": 0.9}

    unset = (await prepare(entry=catalog_model, request=GenerationRequest(messages=QUESTION))).job.sampling
    asked = (
        await prepare(entry=catalog_model, request=GenerationRequest(messages=QUESTION, temperature=1.3, top_p=1.0))
    ).job.sampling

    assert (unset.temperature, unset.top_p, unset.frequency_penalty) == (0.2, 0.9, 0.0)
    assert (asked.temperature, asked.top_p) == (1.3, 1.0)


async def test_without_defaults_a_request_samples_as_openai_does(catalog_model: CatalogEntry) -> None:
    sampling = (await prepare(entry=catalog_model, request=GenerationRequest(messages=QUESTION))).job.sampling

    assert (sampling.temperature, sampling.top_p) == (1.0, 1.0)


@pytest.mark.parametrize(
    "defaults", [{"temperature": 3}, {"top_p": "high"}, {"top_k": 40}, {"temperature": True}, ["temperature"]]
)
def test_the_admin_refuses_defaults_that_are_not_sampling_parameters_in_range(
    catalog_model: CatalogEntry, defaults: object
) -> None:
    catalog_model.sampling_defaults = defaults
    with pytest.raises(ValidationError) as refused:
        catalog_model.full_clean()
    assert "sampling_defaults" in refused.value.message_dict


def test_a_fresh_install_samples_the_embedded_model_as_its_model_card_says(tmp_path: Path) -> None:
    env = {**os.environ, "B3OS_VAR_DIR": str(tmp_path), "DATABASE_URL": "", "REDIS_URL": ""}
    manage("migrate", "--noinput", "-v0", env=env)

    shown = manage(
        "shell",
        "-c",
        "from inference.models import CatalogEntry as C; "
        f"print(C.objects.get(public_id={MODEL_ID!r}).sampling_defaults)",
        env=env,
    )

    assert shown.strip().splitlines()[-1] == "{'temperature': 0.2, 'top_p': 0.9}"


async def test_a_response_echoes_the_sampling_it_applied(api: API, catalog_model: CatalogEntry) -> None:
    await CatalogEntry.objects.filter(pk=catalog_model.pk).aupdate(sampling_defaults={"temperature": 0.2, "top_p": 0.9})
    body = {"model": MODEL_ID, "input": "Hi", "max_output_tokens": 16}

    unset = (await api.post("/v1/infer/responses", body)).json()
    asked = (await api.post("/v1/infer/responses", {**body, "temperature": 0.7})).json()

    assert (unset["temperature"], unset["top_p"]) == (0.2, 0.9)
    assert (asked["temperature"], asked["top_p"]) == (0.7, 0.9)
