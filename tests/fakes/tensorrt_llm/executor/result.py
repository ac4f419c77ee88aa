"""Mirrors ``tensorrt_llm/executor/result.py``: the per-request result the LLM API streams.

As in the real module, a result created inside a running event loop gets an asyncio queue and can be
iterated with ``async for``; one created outside a loop gets a thread queue and async iteration fails
with the real assertion. Every response from the engine updates the single ``CompletionOutput`` in
place (``_last_*_len`` remember the previous lengths, so the ``*_diff`` properties give what is new).

Stop strings end a request in two ways, both kept here:

- the runtime matched a stop string's token ids (``STOP_WORDS``): ``_handle_sequence`` cuts those ids
  from ``token_ids``, but a streamed result detokenizes incrementally (``decode_incrementally``
  appends the new ids' text to the previous text), so the text of the stop string's first tokens,
  sent in earlier steps, stays in ``text``;
- the stop string appears in the detokenized text (its ids differ, e.g. a leading space):
  ``DetokenizedGenerationResultBase._handle_response`` cuts the cumulative ``text`` there, sets
  ``finish_reason`` "stop" and ``stop_reason``, aborts the request and ends the iteration.

A response carrying an error is raised as ``RequestError`` (the executor's background error handler
does so for a per-request error string). An error one of the executor's own threads failed with is raised,
once the handler has shut the executor down, by whichever result handles a response next.
"""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..sampling_params import SamplingParams
from .utils import has_event_loop

if TYPE_CHECKING:
    from .._toy import EngineResponse, ToyExecutor


@dataclass(slots=True)
class Logprob:
    """Holds logprob and vocab rank for a token."""

    logprob: float
    rank: int | None = None


TokenLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] | None = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: TokenLogprobs | list[float] | None = field(default_factory=list)
    prompt_logprobs: TokenLogprobs | None = field(default_factory=list)
    finish_reason: Literal["stop", "length", "timeout", "cancelled"] | None = None
    stop_reason: int | str | None = None

    _last_text_len: int = field(default=0, init=False, repr=False)
    _last_token_ids_len: int = field(default=0, init=False, repr=False)
    _last_logprobs_len: int = field(default=0, init=False, repr=False)
    _incremental_states: dict[str, Any] | None = field(default=None, init=False, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids or [])

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        return (self.token_ids or [])[self._last_token_ids_len :]

    @property
    def logprobs_diff(self) -> TokenLogprobs | list[float]:
        return (self.logprobs or [])[self._last_logprobs_len :]


# tllm.FinishReason of the C++ runtime, as the engine reports it.
END_ID = "END_ID"
STOP_WORDS = "STOP_WORDS"
LENGTH = "LENGTH"
TIMED_OUT = "TIMED_OUT"
CANCELLED = "CANCELLED"


class GenerationResult:
    def __init__(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        streaming: bool,
        executor: ToyExecutor,
        tokenizer: Any,
    ) -> None:
        self.id = -1
        self.sampling_params = sampling_params
        self.cached_tokens = 0
        self.decoding_iter = 0
        self.tokenizer = tokenizer
        self._prompt_token_ids = list(prompt_token_ids)
        self._streaming = streaming
        self._executor = executor
        self._aborted = False
        self._done = False
        self._outputs = [CompletionOutput(i) for i in range(sampling_params.best_of or 1)]
        self._loop: asyncio.AbstractEventLoop | None
        self.aqueue: asyncio.Queue[EngineResponse] | None
        self.queue: queue.Queue[EngineResponse]
        if has_event_loop():
            self._loop = asyncio.get_running_loop()
            self.aqueue = asyncio.Queue()
            self.queue = queue.Queue()
        else:
            self._loop = None
            self.aqueue = None
            self.queue = queue.Queue()

    # -- what the engine calls, from its own thread ------------------------------------------------
    def _deliver(self, response: EngineResponse) -> None:
        if self.aqueue is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.aqueue.put_nowait, response)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass
        else:
            self.queue.put(response)

    # -- the public surface ------------------------------------------------------------------------
    @property
    def request_id(self) -> int:
        return self.id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_token_ids

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self._outputs[: self.sampling_params.n]

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Abort the generation request."""
        assert self._executor is not None, "The executor is not set for this result."
        self._executor.abort_request(self.request_id)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def __aiter__(self) -> GenerationResult:
        return self

    async def __anext__(self) -> GenerationResult:
        if self._done:
            raise StopAsyncIteration
        assert self.aqueue is not None, (
            "The asyncio event loop was not present during initialization, so async operations are not available."
        )
        response = await self.aqueue.get()
        self._handle_response(response)
        return self

    async def aresult(self) -> GenerationResult:
        while not self._done:
            await self.__anext__()
        return self

    # -- response handling, after GenerationResultBase._handle_response and _handle_sequence --------
    def _handle_response(self, response: EngineResponse) -> None:
        assert self._executor is not None
        if response.error is not None:
            # The executor's background error handler raises a per-request error string as RequestError.
            self._executor._handle_background_error(response.error)
        self._done = response.is_final
        self.cached_tokens = response.cached_tokens
        self.decoding_iter += 1
        output = self._outputs[0]
        output._last_token_ids_len = len(output.token_ids or [])
        assert output.token_ids is not None
        output.token_ids.extend(response.token_ids)
        if response.logprobs is not None:
            logprobs: list[Any] = output.logprobs if output.logprobs is not None else []
            output._last_logprobs_len = len(logprobs)
            output.logprobs = logprobs + response.logprobs
        if response.finish_reason == CANCELLED:
            output.finish_reason = "cancelled"
        params = self.sampling_params
        if self._done:
            if response.finish_reason == END_ID:
                output.finish_reason = "stop"
            elif response.finish_reason == STOP_WORDS:
                output.finish_reason = "stop"
                for stop_reason, stop_ids in params._get_stop_reasons_and_words():
                    if stop_ids and output.token_ids[-len(stop_ids) :] == stop_ids:
                        output.stop_reason = stop_reason
                        if not params.include_stop_str_in_output:
                            output.token_ids = output.token_ids[: -len(stop_ids)]
                        break
            elif response.finish_reason == LENGTH:
                output.finish_reason = "length"
            elif response.finish_reason == TIMED_OUT:
                output.finish_reason = "timeout"
            elif response.finish_reason != CANCELLED:
                raise ValueError(f"Unknown finish reason: {response.finish_reason}")

        # Background errors are raised here, as soon as any result handles a response.
        self._executor._handle_background_error()

        # DetokenizedGenerationResultBase._handle_response
        if params.detokenize and self.tokenizer is not None:
            output._last_text_len = len(output.text)
            kwargs = {"skip_special_tokens": params.skip_special_tokens}
            if self._streaming and hasattr(self.tokenizer, "decode_incrementally"):
                output.text, output._incremental_states = self.tokenizer.decode_incrementally(
                    output.token_ids_diff,
                    prev_text=output.text,
                    states=output._incremental_states,
                    flush=self._done,
                    **kwargs,
                )
            else:
                output.text = self.tokenizer.decode(output.token_ids, **kwargs)
            if not self._done or output.finish_reason in ("stop", "length"):
                for stop_reason, _ in params._get_stop_reasons_and_words():
                    if isinstance(stop_reason, str) and stop_reason in output.text:
                        stop_pos = output.text.find(stop_reason)
                        if params.include_stop_str_in_output:
                            output.text = output.text[: stop_pos + len(stop_reason)]
                        else:
                            output.text = output.text[:stop_pos]
                        output.finish_reason = "stop"
                        output.stop_reason = stop_reason
                        self.abort()
                        self._done = True
                        break
