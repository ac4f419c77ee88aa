from __future__ import annotations

import pytest

from inference.models import CatalogEntry
from tests.conftest import API, MODEL_ID, OpenAISpec

pytestmark = pytest.mark.django_db(transaction=True)


async def test_it_lists_the_enabled_models_as_openai_does(api: API, openai_spec: OpenAISpec) -> None:
    await CatalogEntry.objects.acreate(public_id="b3os/off", enabled=False)
    response = await api.get("/v1/infer/models")
    assert response.status_code == 200
    body = response.json()
    openai_spec.validate("ListModelsResponse", body)
    assert [m["id"] for m in body["data"]] == [MODEL_ID]
    assert body["data"][0]["b3os"] == {
        "json_schema": True,
        "image_input": False,
        "tools": True,
        "reasoning": False,
        "route": "node",
    }


async def test_it_retrieves_one_model_by_its_id_with_a_slash(api: API, openai_spec: OpenAISpec) -> None:
    response = await api.get(f"/v1/infer/models/{MODEL_ID}")
    assert response.status_code == 200
    openai_spec.validate("Model", response.json())
    assert response.json()["id"] == MODEL_ID
    assert response.json()["owned_by"] == "b3os"


@pytest.mark.parametrize("model_id", ["b3os/unknown", "b3os/off"])
async def test_an_unknown_or_disabled_model_is_not_available(api: API, model_id: str) -> None:
    await CatalogEntry.objects.acreate(public_id="b3os/off", enabled=False)
    response = await api.get(f"/v1/infer/models/{model_id}")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_available"
    assert response.json()["error"]["type"] == "invalid_request_error"  # as OpenAI types an unknown model


async def test_a_fresh_install_serves_the_embedded_default(transactional_db: None) -> None:
    # The data migration's entry (restored per test by get_or_create elsewhere) names the packaged GGUF.
    from inference.engine.runners.llama_cpp import model_path
    from tests.conftest import DEFAULT_MODEL

    assert DEFAULT_MODEL["runner"] == "llama_cpp"
    assert model_path(DEFAULT_MODEL["runner_settings"]).endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
