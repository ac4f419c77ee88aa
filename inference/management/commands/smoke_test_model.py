from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Any

from django.core.management.base import CommandError, CommandParser

from core.commands import OperatorCommand
from inference.engine.exceptions import EngineError
from inference.engine.execution import JobFailed, get_runner, run_job
from inference.engine.generation import GenerationRequest, prepare
from inference.engine.runners.base import Finished, RunnerError, TextChunk
from inference.models import GATEWAY, CatalogEntry


def _token_count(value: str) -> int:
    count = int(value) if value.strip().isdigit() else 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"a token count is a whole number of 1 or more, not {value!r}")
    return count


class Command(OperatorCommand):
    help = (
        "Load a catalog model in this process, as its worker does, and stream one completion from it: "
        "the smoke test of a model host. Exits non-zero when the model does not load or generate."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model", help="The catalog model's public id, e.g. b3os/qwen2.5-7b-instruct.")
        parser.add_argument("--prompt", default="Say hello in one short sentence.", help="The user message.")
        parser.add_argument(
            "--max-tokens", type=_token_count, default=32, help="At most this many tokens, 1 or more (default 32)."
        )

    def handle(self, *args: Any, model: str, prompt: str, max_tokens: int, **options: Any) -> None:
        entry = CatalogEntry.objects.filter(public_id=model).first()
        if entry is None:
            raise CommandError(f"There is no catalog model {model!r}.")
        if entry.runner == GATEWAY:
            raise CommandError(f"{entry.public_id} has no runner here: it is served only through the gateway.")
        started = time.monotonic()
        try:
            get_runner(entry.runner, entry.runner_settings)
        except RunnerError as exc:
            raise CommandError(f"{entry.public_id} did not load: {exc}") from None
        self.stdout.write(f"{entry.public_id}: {entry.runner} loaded in {time.monotonic() - started:.1f} s")
        asyncio.run(self._complete(entry, prompt, max_tokens))

    async def _complete(self, entry: CatalogEntry, prompt: str, max_tokens: int) -> None:
        request = GenerationRequest(
            messages=[{"role": "user", "content": prompt}], max_output_tokens=max_tokens, temperature=0.0
        )
        try:
            generation = await prepare(entry=entry, request=request)
        except EngineError as exc:
            raise CommandError(f"The request was refused: {exc}") from None
        started = time.monotonic()
        first_token: float | None = None
        async for batch in run_job(generation.job, threading.Event()):
            for event in batch:
                if isinstance(event, TextChunk):
                    first_token = first_token or time.monotonic()
                    self.stdout.write(event.text, ending="")
                    self.stdout.flush()
                elif isinstance(event, Finished):
                    elapsed = time.monotonic() - started
                    to_first = f"{(first_token - started) * 1000:.0f} ms" if first_token else "-"
                    self.stdout.write("")
                    self.stdout.write(
                        f"finish_reason={event.reason} prompt_tokens={event.prompt_tokens} "
                        f"completion_tokens={event.completion_tokens} first_token={to_first} total={elapsed:.2f} s"
                    )
                elif isinstance(event, JobFailed):
                    self.stdout.write("")
                    raise CommandError(f"Generation failed: {event.code}: {event.message}")
