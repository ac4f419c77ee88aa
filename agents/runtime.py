"""The agent loop: one turn of a conversation, from the instance and the items to the event stream.

A turn checks the user's new input against the input guardrails, optionally searches the knowledge
first, then runs the model in steps: when the model calls a server tool, the runtime runs it, shows it
as an ``agent_runtime:function_call`` item with its arguments and its output or error, feeds the result
back and runs the model again; when it calls one of the client's tools, the turn ends with the
``function_call`` item; otherwise the model's message is the answer. The model gets at most
``AGENT_MAX_STEPS`` steps, the last one without tools, and all steps share ``max_output_tokens``.

Server tools' results reach the model as context in its system message, not as tool-call turns of the
transcript: the client never sees those turns, and small models parrot them (SmolLM2-135M copies a
``<tool_response>`` block verbatim, yet answers from the same text given as context). The transcript's
tool calls are the client's own ``function_call`` items. The context holds this turn's runs whole and earlier
turns' within a share of the model's context, each document once (``tool_context``).

Citations: every document a knowledge search returned in this turn is cited by the message(s) closed
after it, as a ``url_citation`` over the whole text. The tiny models this runs on cannot be trusted to
cite sources by number, so the runtime cites what it gave the model rather than what the model claims.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import regex
from django.conf import settings
from django.db import IntegrityError

from inference.engine import capabilities
from inference.engine.decoding import (
    ForcedFunction,
    FunctionTool,
    ReasoningPiece,
    TextPiece,
    ToolCallDelta,
    ToolCallPiece,
    ToolCallStart,
    ToolChoice,
    new_call_id,
    parse_json,
)
from inference.engine.exceptions import ContextLengthExceeded
from inference.engine.generation import Done, Failed, Generation, GenerationRequest, Logprobs, prepare, renderer_for
from inference.engine.prompting import Message
from inference.models import CatalogEntry
from inference.openai import responses as wire
from inference.openai.errors import UNAVAILABLE_CODES, APIError, from_exception, invalid_request
from inference.openai.shared import response_usage
from inference.serving import responses, revocation
from inference.serving.caller import generation_error
from inference.serving.metered import CLIENT_DISCONNECTED, StreamOutcome

from .guardrails import Guardrails, Rule
from .models import FirstStep
from .protocol import AGENT_CALL, AgentResponseRequest, agent_call_item
from .tools.knowledge import KNOWLEDGE_SEARCH, found_documents
from .tools.registry import ServerTool, Source, ToolContext, ToolOutcome, run_tool
from .tools.search import query_terms

logger = logging.getLogger("agents.runtime")


@dataclass(frozen=True, slots=True)
class Agent:
    """An instance as one request sees it, loaded once."""

    pk: int
    instance_id: str
    entry: CatalogEntry
    instructions: str
    tools: tuple[ServerTool, ...]
    first_step: str
    reasons: bool
    guardrails: Guardrails
    temperature: float | None = None
    max_output_tokens: int | None = None

    def tool(self, name: str) -> ServerTool | None:
        return next((tool for tool in self.tools if tool.name == name), None)


def output_limit(params: AgentResponseRequest, agent: Agent) -> int:
    """The response's output tokens, all steps together: the request's (within the model's, or refused before), else
    the instance's within the model's, else the model's."""
    most = agent.entry.max_output_tokens
    return params.max_output_tokens or min(agent.max_output_tokens or most, most)


def temperature(params: AgentResponseRequest, agent: Agent) -> float | None:
    return params.temperature if params.temperature is not None else agent.temperature


# --- items to the model's conversation ---------------------------------------------------------------


# What the model reads of the arguments a tool ran with: enough to tell one run from another. The search an instance
# runs first takes the user's whole message as its query, and the message is in the conversation already: read
# twice, it would take twice its tokens, and a message past half the context would fail once the search had run.
CONTEXT_ARGUMENTS_CHARACTERS = 200


# Earlier turns' runs stay context the model may need ("how often is its filter changed?"), but every turn adds its
# own: given whole, they grew a conversation's prompt by each turn's results, the same documents again and again,
# until it no longer fit the model's context. So a document is given once, with the latest run that found it, and
# earlier turns' runs take at most this share of the context, the latest first: the oldest give way. This turn's
# runs are given whole, for the answer is written from them.
EARLIER_RUNS_CONTEXT_SHARE = 0.25
# Characters that take no more tokens than this many: English averages about four a token, URLs and numbers fewer.
CHARACTERS_PER_TOKEN = 3


def earlier_runs_budget(context_length: int) -> int:
    """The characters earlier turns' server tool runs may take of a model's context."""
    return int(context_length * EARLIER_RUNS_CONTEXT_SHARE) * CHARACTERS_PER_TOKEN


def _run_context(call: dict[str, Any], given: set[tuple[str, str]]) -> str | None:
    """A server tool's run as the model reads it, without what ``given`` holds (to which it adds what it gives):
    a document found before, or the same result of the same run; ``None`` when nothing is left."""
    name = call.get("name")
    arguments = call.get("arguments") or "{}"
    if len(arguments) > CONTEXT_ARGUMENTS_CHARACTERS:
        arguments = arguments[:CONTEXT_ARGUMENTS_CHARACTERS] + "…"
    heading = f"{name} {arguments}:\n"
    parts: list[tuple[str | None, str]]
    if call.get("error") is not None:
        parts = [(None, f"Failed: {call['error']}")]
    elif name == KNOWLEDGE_SEARCH.name:
        parts = found_documents(call.get("output") or "")
    else:
        parts = [(None, call.get("output") or "")]
    fresh = []
    for document, text in parts:
        key = ("document", document) if document is not None else ("run", heading + text)
        if key not in given:
            given.add(key)
            fresh.append(text)
    return heading + "\n\n".join(fresh) if fresh else None


def tool_context(earlier: list[dict[str, Any]], current: list[dict[str, Any]], *, budget: int) -> str:
    """The server tools' runs of a conversation, as the context block of the system message, in the order they ran:
    ``current`` (this turn's) whole, and of ``earlier``, the latest that fit in ``budget`` characters; each document
    once, with the latest run that found it."""
    given: set[tuple[str, str]] = set()
    runs = [text for call in reversed(current) if (text := _run_context(call, given)) is not None]
    for call in reversed(earlier):
        if (text := _run_context(call, given)) is None:
            continue
        budget -= len(text)
        if budget < 0:
            break
        runs.append(text)
    if not runs:
        return ""
    return "Results of the tools run for this conversation:\n" + "\n\n".join(reversed(runs))


@dataclass
class Transcript:
    """A turn's conversation so far: the items the client knows, each typed once with where the client sent it
    (``input.3``; ``previous_response_id`` for stored history; ``output`` for this turn's), and the server
    tools' runs, which reach the model as context instead."""

    items: list[responses.LocatedItem] = field(default_factory=list)
    earlier_calls: list[dict[str, Any]] = field(default_factory=list)  # the server tools' runs of earlier turns
    calls: list[dict[str, Any]] = field(default_factory=list)  # and of this turn
    _ran: dict[str, str] = field(default_factory=dict)  # a server tool call's call_id: where it is

    def add(self, where: str, item: dict[str, Any]) -> None:
        if item.get("type") == AGENT_CALL:
            (self.calls if where == "output" else self.earlier_calls).append(item)
            self._ran.setdefault(item["call_id"], where)
            return
        typed = wire.input_item(item)
        if isinstance(typed, wire.FunctionCallOutput) and (ran := self._ran.get(typed.call_id)) is not None:
            # Told apart from a call_id nobody made: this call was the service's to run, never the client's.
            at = "in the stored conversation" if ran == "previous_response_id" else f"at {ran}"
            raise invalid_request(
                f"call_id {json.dumps(typed.call_id)} is the {AGENT_CALL} {at}: the service ran it itself, and its "
                "output is in that item. Send a function_call_output only for a function_call.",
                param=where if where == "previous_response_id" else f"{where}.call_id",
                code="invalid_value",
            )
        self.items.append((where, typed))

    def messages(self, *, instructions: str, context_length: int) -> list[Message]:
        """The chat-template messages for a model of ``context_length`` tokens, checked as the stateless API checks
        its input."""
        runs = tool_context(self.earlier_calls, self.calls, budget=earlier_runs_budget(context_length))
        system = "\n\n".join(filter(None, [instructions, runs]))
        return responses.conversation(self.items, instructions=system or None)


def _is_json(text: str) -> bool:
    try:
        parse_json(text)
    except ValueError:
        return False
    return True


def _text(content: Any) -> str:
    """A message's text as the model reads it: its text parts run together, as the prompt joins them (a term
    split across parts is still seen whole)."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or () if isinstance(part, dict))


GUARDED_ROLES = frozenset({"user", "system", "developer"})


def client_texts(stored: list[dict[str, Any]], sent: list[dict[str, Any]], *, instructions: str | None) -> list[str]:
    """What the client wrote for the model, for the input guardrails: the request's instructions, the text of every
    user, system and developer message the model is to read (not only the last), stored or ``sent`` with this
    request, and the outputs of the client's functions, which its application writes (what its user typed into a
    form, say). Of what is sent, the rest too: an assistant message, a call's arguments, a server tool's run sent
    back with ``store: false`` are the client's to write as it likes, and the model reads them all the same (a
    server tool's run as the context of its system message). The stored turns' are the runtime's own record."""
    texts = [instructions or ""]
    for item in [*stored, *sent]:
        if item.get("type", "message") == "message" and item.get("role") in GUARDED_ROLES:
            texts.append(_text(item.get("content")))
        elif item.get("type") == "function_call_output":
            texts.append(_text(item.get("output")))
    for item in sent:
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            texts.append(_text(item.get("content")))
        elif kind == "function_call":
            texts.append(str(item.get("arguments") or ""))
        elif kind == AGENT_CALL:
            texts += [str(item.get(part) or "") for part in ("arguments", "output", "error")]
    return [text for text in texts if text.strip()]


def refused_exchanges(items: list[dict[str, Any]]) -> frozenset[int]:
    """The places of every exchange the runtime refused in a conversation: a refusal and everything since the
    assistant's message before it (the question, the searches and calls made for it, their outputs), but the
    client's system and developer messages, which hold for the rest of the conversation. Neither the model nor the
    input guardrails read them again: a refused text does not come back with the next turn, stored or sent again
    with ``store: false``, and the conversation goes on without it."""
    left_out: set[int] = set()
    start = 0
    for index, item in enumerate(items):
        if item.get("type", "message") != "message" or item.get("role") != "assistant":
            continue
        if _is_refusal(item):
            left_out.update(i for i in range(start, index + 1) if items[i].get("role") not in ("system", "developer"))
        start = index + 1
    return frozenset(left_out)


def _is_refusal(item: dict[str, Any]) -> bool:
    content = item.get("content")
    return (
        item.get("type", "message") == "message"
        and item.get("role") == "assistant"
        and isinstance(content, list)
        and any(isinstance(part, dict) and part.get("type") == "refusal" for part in content)
    )


def new_user_text(items: list[dict[str, Any]]) -> str:
    """The text of the user's new messages: those at the end of the input, after the last other item."""
    texts: list[str] = []
    for item in reversed(items):
        if item.get("type", "message") != "message" or item.get("role") != "user":
            break
        texts.append(_text(item.get("content")))
    return "\n".join(reversed(texts)).strip()


# --- one turn ------------------------------------------------------------------------------------------


@dataclass
class StepUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0


def _unfinished(generation: Generation) -> StepUsage:
    """What a step that did not finish counts: what it produced, and nothing when it ended before its first token
    (as a node request that ended so: ``metered.generation_outcome``)."""
    if generation.first_token_at is None:
        return StepUsage(0, 0)
    return StepUsage(generation.prompt_tokens, generation.completion_tokens, generation.cached_tokens)


class TurnFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class AgentTurn:
    """Runs one turn and streams it; afterwards ``steps``, ``failure`` and ``finished`` tell how it went.

    ``keep`` stores the finished response (``None`` with ``store: false``). The turn is one request, with one
    usage record under its catalog model (``outcome``), however many server tools it runs: their runs are
    shown in the stream and kept in the stored response, never counted as requests.
    """

    agent: Agent
    params: AgentResponseRequest
    history: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    encoder: responses.ResponseEncoder
    context: ToolContext
    keep: Callable[[dict[str, Any]], Awaitable[None]] | None
    request_id: str
    api_key_id: int | None = None  # the key the turn answers: a step under way ends if it is revoked
    steps: list[StepUsage] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    first_token_at: float | None = None
    failure: TurnFailed | None = None
    finished: bool = False
    # Counts tokens against the organization's tokens per minute once the turn is admitted (``Grant.charge``).
    charge: Callable[[int], Awaitable[None]] | None = None
    _first: Generation | None = None
    # What ``prepare_first`` found before the response began: the input guardrail's refusal, and the call of the
    # search the instance runs first with its result.
    _refusal: Rule | None = None
    _searched: tuple[dict[str, str], dict[str, Any]] | None = None
    _running: Generation | None = None  # the step running now, not yet in ``steps``
    _model_took_a_step: bool = False  # whether a model took any step's job (a full queue takes none)
    # The first step's prompt tokens, which admission charged before that step ran.
    _precharged: int = 0
    _server_calls: int = 0
    _transcript: Transcript = field(default_factory=Transcript)
    _output_seen: int = 0  # how many of the encoder's output items the transcript holds
    _read: list[dict[str, Any]] = field(default_factory=list)  # the conversation as the model reads it
    _sent: list[dict[str, Any]] = field(default_factory=list)  # of it, what this request's input holds

    def __post_init__(self) -> None:
        self.encoder.annotate = self._citations
        left_out = refused_exchanges([*self.history, *self.input_items])
        for index, item in enumerate(self.history):
            if index not in left_out:
                self._transcript.add("previous_response_id", item)
        for index, item in enumerate(self.input_items):
            if len(self.history) + index not in left_out:
                self._transcript.add(f"input.{index}", item)
        stored = [item for index, item in enumerate(self.history) if index not in left_out]
        self._sent = [item for index, item in enumerate(self.input_items) if len(self.history) + index not in left_out]
        self._read = [*stored, *self._sent]

    # --- the request as generations

    @property
    def client_tools(self) -> tuple[FunctionTool, ...]:
        return tuple(FunctionTool(t.name, t.description, t.parameters, t.strict) for t in self.params.function_tools)

    @property
    def reasoning(self) -> bool:
        return capabilities.reasoning_on(
            model_reasons=self.agent.reasons and self.agent.entry.reasoning, effort=self.params.reasoning_effort
        )

    @property
    def budget(self) -> int:
        return output_limit(self.params, self.agent) - sum(step.completion_tokens for step in self.steps)

    @property
    def tool_calls_spent(self) -> bool:
        """``max_tool_calls`` bounds every server tool run of the response, the search an instance runs first too."""
        return self.params.max_tool_calls is not None and self._server_calls >= self.params.max_tool_calls

    def _step_tools(self, step: int) -> tuple[tuple[FunctionTool, ...], ToolChoice]:
        """The tools offered on ``step`` and how the model must use them.

        An instance that must call a server tool first does so on the first step, whatever the client asked but
        ``none``. Then a named function is forced on the step where the model speaks. ``required`` with client tools
        lets server tools run but ends with a client call: the last step offers only the client's tools.
        ``required`` without client tools is met by a server tool call on the first step; the model then
        answers. Server tools are not offered on the last step, nor once ``max_tool_calls`` are spent.
        """
        asked = self.params.tool_choice
        client = self.client_tools
        last = step == settings.AGENT_MAX_STEPS - 1
        spent = self.tool_calls_spent
        server = (
            () if last or spent else tuple(tool.function_tool() for tool in self.agent.tools if self._offered(tool))
        )
        if asked == "none":
            return server + client, "none"
        if step == 0 and server and (self.agent.first_step == FirstStep.TOOL or (asked == "required" and not client)):
            return server, "required"
        if isinstance(asked, wire.ToolChoiceFunction):
            return server + client, ForcedFunction(asked.name)
        if asked == "required" and client:
            return server + client, "required"
        choice: ToolChoice = "auto" if (server or client) and not last and not spent else "none"
        return server + client, choice

    async def prepare_step(self, step: int) -> Generation:
        """The model's next step; raises ``ContextLengthExceeded`` if it cannot fit."""
        tools, choice = self._step_tools(step)
        # Between steps no output item is open: the new ones are final.
        for item in self.encoder.output[self._output_seen :]:
            self._transcript.add("output", item)
        self._output_seen = len(self.encoder.output)
        instructions = "\n\n".join(filter(None, [self.agent.instructions, self.params.instructions]))
        messages = self._transcript.messages(instructions=instructions, context_length=self.agent.entry.context_length)
        request = GenerationRequest(
            messages=messages,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=self.params.parallel_tool_calls is not False,
            reasoning=self.reasoning,
            max_output_tokens=self.budget,
            # The instance's limit or the model's, which the client did not set; and past the first step what is left
            # of the client's, whose steps' tool results it could not foresee: refused only before the response.
            fit_output=self.params.max_output_tokens is None or step > 0,
            temperature=temperature(self.params, self.agent),
            top_p=self.params.top_p,
            logprobs=self.params.wants_logprobs,
            top_logprobs=(self.params.top_logprobs or 0) if self.params.wants_logprobs else 0,
        )
        generation = await prepare(entry=self.agent.entry, request=request)
        if self.api_key_id is not None:
            revocation.watch(generation, self.api_key_id)
        return generation

    async def _charge_prompt(self, tokens: int) -> None:
        """A step's prompt counts against tokens per minute, less what admission charged for it."""
        extra, self._precharged = tokens - self._precharged, 0
        if self.charge is not None and extra > 0:
            await self.charge(extra)

    @property
    def refused(self) -> bool:
        """Whether the input guardrails refused the turn (known once ``prepare_first`` has run): no model runs."""
        return self._refusal is not None

    def _offered(self, tool: ServerTool) -> bool:
        """Instances that search first do not offer the search to the model: the runtime has searched. Unless it has
        not (a message with nothing to search for) while ``tool_choice: required`` asks for a server tool call."""
        if self.agent.first_step == FirstStep.SEARCH and tool.name == KNOWLEDGE_SEARCH.name:
            return self._server_calls == 0 and self.params.tool_choice == "required" and not self.client_tools
        return True

    async def prepare_first(self) -> Generation:
        """The first model step, before the response begins: what admission charges for, and the context check
        that can still be answered with a plain 400. The input guardrail is checked, and the search an instance
        runs first is run, here: its results are in that step's prompt, charged and checked with it."""
        # The stored turns too, as when a client sends them all with store: false: a guardrail may have been added
        # since a turn ran. Exchanges refused before are not read again (``refused_exchanges``).
        stored = self._read[: len(self._read) - len(self._sent)]
        checked = client_texts(stored, self._sent, instructions=self.params.instructions)
        await self._check_fits(checked)
        self._refusal = await self.agent.guardrails.check_input(checked)
        if self._refusal is None and (search := self._search_first()) is not None:
            arguments = json.dumps({"query": new_user_text(self.input_items)}, ensure_ascii=False)
            call = self._call(search, arguments, new_call_id())
            item = await self._run_tool(search, call)
            self._transcript.add("output", item)
            self._searched = (call, item)
        self._first = await self.prepare_step(0)
        self._precharged = self._first.prompt_tokens
        return self._first

    async def _check_fits(self, texts: list[str]) -> None:
        """Texts that could not fit the model's context whatever their exact count (more bytes than its tokens could
        carry) are refused before the guardrails read them: reading megabytes holds the process's one interpreter
        for seconds, past every other answer's guardrail time."""
        entry = self.agent.entry
        renderer = await renderer_for(entry)
        if (least := renderer.least_tokens("".join(texts))) > entry.context_length:
            raise ContextLengthExceeded(
                prompt_tokens=least, context_length=entry.context_length, requested_output=None, at_least=True
            )

    def _search_first(self) -> ServerTool | None:
        """The search the instance runs before the model's first step, if it runs one on this input."""
        search = self.agent.tool(KNOWLEDGE_SEARCH.name)
        if (
            self.agent.first_step != FirstStep.SEARCH
            or search is None
            # A message of common words only ("Why is it so?") has nothing to search for: searched, it would be
            # shown as a failed tool, which the runtime and not the model chose to run.
            or not query_terms(new_user_text(self.input_items))
            or self.params.tool_choice == "none"  # calls nothing: not even the search the instance runs first
            or self.tool_calls_spent
        ):
            return None
        return search

    # --- the stream

    async def events(self) -> AsyncGenerator[str, None]:
        for event in self.encoder.start():
            yield responses.sse(event)
        try:
            async for events in self._turn():
                for event in events:
                    yield responses.sse(event)
        except (GeneratorExit, asyncio.CancelledError):
            # The client hung up: what was produced is kept as a cancelled response it can still continue from.
            # Stored apart from this stream, whose task is going away.
            if not self.finished:
                self._end_running_calls("The response was cancelled before the tool finished.")
                self.encoder.cancel()
                _detached.add(task := asyncio.get_running_loop().create_task(self._keep_quietly()))
                task.add_done_callback(_detached.discard)
            raise
        except Exception as exc:
            if isinstance(exc, TurnFailed):
                failure = exc
            elif (error := from_exception(exc, self.params.param_names())) is not None:
                failure = TurnFailed(error.code, error.message)
            else:
                logger.exception("agent response %s failed", self.encoder.response_id)
                failure = TurnFailed("internal_error", "The server had an error while generating the response.")
            self.failure = failure
            events = self.encoder.fail(failure.message, error_code=failure.code, usage=self._spent())
            await self._keep_quietly()
            self.finished = True
            for event in events:
                yield responses.sse(event)

    async def _turn(self) -> AsyncGenerator[list[dict[str, Any]], None]:
        if self._refusal is not None:
            yield self.encoder.refuse(self._refusal.refusal)
            yield await self._finish("stop")
            return
        if self._searched is not None:
            # Run before the response began; its item is in the transcript already.
            searched, item = self._searched
            index, opened = self.encoder.open_item(agent_call_item(**searched, status="in_progress"))
            yield [*opened, *self.encoder.close_item(index, item)]
            self._output_seen = len(self.encoder.output)
        finish_reason = "stop"
        for step in range(settings.AGENT_MAX_STEPS):
            if self.budget <= 0:
                finish_reason = "length"
                break
            first, self._first = self._first, None
            generation = first if step == 0 else None
            if generation is None:
                # Later steps hold tool results.
                generation = await self.prepare_step(step)
                await self._charge_prompt(generation.prompt_tokens)
            self._precharged = 0
            outcome = _StepOutcome()
            async for events in self._step(generation, outcome):
                yield events
            if outcome.refused:
                break
            for call in outcome.server_calls:
                tool = self.agent.tool(call.name)
                assert tool is not None
                async for events in self._run_server_call(tool, call.arguments, call.call_id):
                    yield events
            if outcome.external_call or not outcome.server_calls:
                finish_reason = outcome.finish_reason
                break
        yield await self._finish(finish_reason)

    async def _step(self, generation: Generation, outcome: _StepOutcome) -> AsyncGenerator[list[dict[str, Any]], None]:
        done: Done | None = None
        # With output guardrails, a word is sent once it has ended: until then a guardrail's whole word at the end
        # of the text so far ("pass") may be the start of another ("passport").
        words = WholeWords() if self.agent.guardrails.on_output else None
        self._running = generation
        try:
            async with aclosing(generation.run()) as pieces:
                async for piece in pieces:
                    if isinstance(piece, Failed):
                        raise TurnFailed(piece.code, generation_error(piece, request_id=self.request_id).message)
                    if isinstance(piece, Done):
                        done = piece
                        break
                    if isinstance(piece, ToolCallStart | ToolCallDelta):
                        continue  # a call goes out whole, once it is known whose it is and its arguments pass
                    for ready in words.through(piece) if words is not None else (piece,):
                        if events := await self._send(ready, outcome):
                            yield events
                        if outcome.refused:
                            break
                    if outcome.refused:
                        break
                if done is not None and words is not None and not outcome.refused:
                    for ready in words.rest():
                        if events := await self._send(ready, outcome):
                            yield events
        finally:
            self._running = None
            self._count(generation, done)
        if done is not None:
            outcome.finish_reason = "length" if done.finish_reason == "length" else "stop"

    async def _send(self, piece: Piece, outcome: _StepOutcome) -> list[dict[str, Any]]:
        """The events of ``piece``, checked before it is sent: blocked words never reach the client, in the answer,
        the reasoning, or the arguments of a call (the client's to run, or shown as the server's); a refusal's
        events instead, when they do."""
        if isinstance(piece, Logprobs):
            return self.encoder.feed(piece)
        if isinstance(piece, ToolCallPiece):
            shown = piece.arguments
        elif isinstance(piece, TextPiece):
            shown = self.encoder.open_text + piece.text
        else:
            shown = self.encoder.open_reasoning + piece.text
        if (rule := await self.agent.guardrails.check_output(shown)) is not None:
            outcome.refused = True
            return self.encoder.refuse(rule.refusal)
        if isinstance(piece, ToolCallPiece) and (tool := self.agent.tool(piece.name)) is not None:
            if piece.complete:
                outcome.server_calls.append(piece)
                return []
            # A call the budget cut short is not run, and is shown failed, with what the model wrote of it: the
            # response ends incomplete.
            call = self._call(tool, piece.arguments, piece.call_id)
            index, opened = self.encoder.open_item(agent_call_item(**call, status="in_progress"))
            cut = "The call was cut short by the output token budget (max_output_tokens), so it was not run."
            return [*opened, *self.encoder.close_item(index, agent_call_item(**call, status="failed", error=cut))]
        if isinstance(piece, ToolCallPiece) and not piece.complete and not _is_json(piece.arguments):
            # Nor is a call of the client's whose arguments the budget cut before they were JSON (one closed early
            # is a valid call, sent incomplete): the protocol has a client run every function_call, and this one
            # cannot be. The turn ends with it all the same, incomplete, its tokens counted.
            outcome.external_call = True
            return []
        outcome.external_call |= isinstance(piece, ToolCallPiece)
        return self.encoder.feed(piece)

    def _count(self, generation: Generation, done: Done | None) -> None:
        self._model_took_a_step |= generation.accepted
        if self.first_token_at is None and generation.first_token_at is not None:
            self.first_token_at = generation.first_token_at
        if done is None:
            self.steps.append(_unfinished(generation))
        else:
            self.steps.append(
                StepUsage(done.prompt_tokens, done.completion_tokens, done.cached_tokens, done.reasoning_tokens)
            )

    async def _run_server_call(
        self, tool: ServerTool, arguments: str, call_id: str
    ) -> AsyncGenerator[list[dict[str, Any]], None]:
        call = self._call(tool, arguments, call_id)
        index, events = self.encoder.open_item(agent_call_item(**call, status="in_progress"))
        yield events
        if self.tool_calls_spent:  # one of several calls of a step, past the limit: shown, not run
            spent = f"The call was not run: the response's max_tool_calls ({self.params.max_tool_calls}) were spent."
            yield self.encoder.close_item(index, agent_call_item(**call, status="failed", error=spent))
        else:
            yield self.encoder.close_item(index, await self._run_tool(tool, call))

    @staticmethod
    def _call(tool: ServerTool, arguments: str, call_id: str) -> dict[str, str]:
        item_id = f"atc_{secrets.token_hex(24)}"
        return {"item_id": item_id, "call_id": call_id, "name": tool.name, "arguments": arguments}

    async def _run_tool(self, tool: ServerTool, call: dict[str, str]) -> dict[str, Any]:
        """Runs a server tool's ``call``; its item as it ended, its sources among the response's."""
        try:
            parsed = parse_json(call["arguments"])
        except ValueError:
            outcome = ToolOutcome(output=None, error="The arguments are not valid JSON.", sources=())
        else:
            outcome = await run_tool(tool, context=self.context, arguments=parsed)
        self._server_calls += 1
        known = {source.url for source in self.sources}
        self.sources += [source for source in dict.fromkeys(outcome.sources) if source.url not in known]
        if outcome.error is None:
            return agent_call_item(**call, status="completed", output=outcome.output)
        return agent_call_item(**call, status="failed", error=outcome.error)

    def _end_running_calls(self, error: str) -> None:
        """A server tool call the response ends in the middle of is kept failed: continued, the conversation shows
        how each tool ended, and nothing stays in progress for ever."""
        for index, item in enumerate(self.encoder.output):
            if item.get("type") == AGENT_CALL and item.get("status") == "in_progress":
                self.encoder.output[index] = {**item, "status": "failed", "error": error}

    def _citations(self, text: str) -> list[dict[str, Any]]:
        if not text.strip():
            return []
        return [
            wire.url_citation(url=source.url, title=source.title, start_index=0, end_index=len(text))
            for source in self.sources
        ]

    async def _finish(self, finish_reason: str) -> list[dict[str, Any]]:
        usage = self.usage
        done = Done(
            finish_reason="length" if finish_reason == "length" else "stop",
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            reasoning_tokens=usage.reasoning_tokens,
        )
        events = self.encoder.finish(done, always_completed=True, ends_with_answer=True)
        if self.keep is not None:
            unstored: TurnFailed | None = None
            try:
                await self.keep(self.encoder.response)
            except APIError as exc:  # the conversation filled up while this turn ran
                unstored = TurnFailed(exc.code, exc.message)
            except Exception:
                logger.exception("storing agent response %s failed", self.encoder.response_id)
                unstored = TurnFailed("store_failed", "The response could not be stored: it cannot be continued.")
            if unstored is not None:
                self.failure = unstored
                events = self.encoder.fail_instead(events, unstored.message, error_code=unstored.code)
        self.finished = True
        return events

    def _spent(self) -> dict[str, Any]:
        """The tokens of the turn so far, as its Response's usage."""
        usage = self.usage
        return response_usage(
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            reasoning_tokens=usage.reasoning_tokens,
        )

    async def _keep_quietly(self) -> None:
        """Keeps a failed or cancelled turn, with the tokens its steps took (a cancelled Response carries none)."""
        if self.keep is not None:
            try:
                await self.keep({**self.encoder.response, "usage": self.encoder.response.get("usage") or self._spent()})
            except APIError:
                pass  # the conversation is full: a failed or cancelled turn is not kept past its caps
            except IntegrityError:
                pass  # kept already: the client hung up while the finished turn was being stored
            except Exception:
                logger.exception("storing failed agent response %s failed", self.encoder.response_id)

    @property
    def usage(self) -> StepUsage:
        """The tokens of every step so far, the one running now too (a turn the client hung up on may be
        stored or recorded before its step has ended)."""
        steps = self.steps
        if (running := self._running) is not None:
            steps = [*steps, _unfinished(running)]
        return StepUsage(
            prompt_tokens=sum(step.prompt_tokens for step in steps),
            completion_tokens=sum(step.completion_tokens for step in steps),
            cached_tokens=sum(step.cached_tokens for step in steps),
            reasoning_tokens=sum(step.reasoning_tokens for step in steps),
        )

    def time_to_first_token_ms(self, started: float) -> int | None:
        return None if self.first_token_at is None else max(0, int((self.first_token_at - started) * 1000))

    def outcome(self, *, started: float) -> StreamOutcome:
        """The turn's one usage record: all its steps' tokens; a turn the client hung up on is a 499."""
        usage = self.usage
        if not self.finished:
            status, error_code = CLIENT_DISCONNECTED, "client_disconnected"
        else:
            status, error_code = 200, self.failure.code if self.failure is not None else ""
        return StreamOutcome(
            status=status,
            error_code=error_code,
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            reasoning_tokens=usage.reasoning_tokens,
            cached_tokens=usage.cached_tokens,
            time_to_first_token_ms=self.time_to_first_token_ms(started),
            no_room=self._had_no_room(),
        )

    def _had_no_room(self) -> bool:
        """Whether the deployment had no room for the turn: it failed as unavailable (a full queue, no worker) before
        any model took a step's job, as a node request refused with a 503 does."""
        failure = self.failure
        return failure is not None and failure.code in UNAVAILABLE_CODES and not self._model_took_a_step


# Stores of cancelled turns still running: the event loop keeps only weak references to tasks.
_detached: set[asyncio.Task[None]] = set()


Piece = TextPiece | ReasoningPiece | ToolCallPiece | Logprobs
# A word still being written, at the end of the text so far; one longer than this holds no guardrail's term. The
# ``regex`` module's word characters, as the guardrails' own (combining marks are part of a word).
_LAST_WORD = regex.compile(r"\w{1,64}\Z")


@dataclass
class WholeWords:
    """Holds back the last word of the answer or the reasoning while it may go on, and the logprobs of what it holds
    back, so that each piece sent comes after its own logprobs. With logprobs, what is held back starts where a token
    does (the one the word begins in, with the space before it): each piece is then its tokens' text exactly."""

    held: TextPiece | ReasoningPiece | None = None
    held_logprobs: list[Logprobs] = field(default_factory=list)  # of the held text
    arrived: list[Logprobs] = field(default_factory=list)  # of the piece to come

    def through(self, piece: Piece) -> list[Piece]:
        """What may be sent now that ``piece`` has come: the text up to its last word, or the call, after what was
        held back (a call, or the other kind of text, ends the word before it)."""
        if isinstance(piece, Logprobs):
            self.arrived.append(piece)
            return []
        if isinstance(piece, ToolCallPiece):
            return [*self.rest(), piece]
        out: list[Piece] = []
        if self.held is not None and type(self.held) is type(piece):
            piece = type(piece)(self.held.text + piece.text)
            self.held = None
        else:
            arrived, self.arrived = self.arrived, []
            out += self.rest()
            self.arrived = arrived
        logprobs = [*self.held_logprobs, *self.arrived]
        self.arrived = []
        last = _LAST_WORD.search(piece.text)
        cut = last.start() if last is not None else len(piece.text)
        if last is not None and logprobs:
            cut = _token_end(piece.text, cut, logprobs)
        sent, self.held_logprobs = (logprobs, []) if last is None else _split(logprobs, len(piece.text[:cut].encode()))
        if cut:
            out += [*sent, type(piece)(piece.text[:cut])]
        if cut < len(piece.text):
            self.held = type(piece)(piece.text[cut:])
        return out

    def rest(self) -> list[Piece]:
        """All that is held back, in order."""
        held, self.held = self.held, None
        out: list[Piece] = [*self.held_logprobs, *([held] if held is not None else []), *self.arrived]
        self.held_logprobs, self.arrived = [], []
        return out


def _token_end(text: str, cut: int, logprobs: list[Logprobs]) -> int:
    """The last place at or before ``cut`` (a character of ``text``, which ``logprobs``' tokens spell) where a token
    ends between two characters: held back from there, each piece sent is spelled by the logprobs sent before it."""
    data, limit, at = text.encode(), len(text[:cut].encode()), 0
    spelled = b"".join(item.token for group in logprobs for item in group.items)[:limit]
    if data[: len(spelled)] != spelled:
        return cut  # out of step with the text (a character the decoder holds back): the word's start it is
    ends = [0]
    for item in (item for group in logprobs for item in group.items):
        at += len(item.token)
        if at > limit:
            break
        ends.append(at)
    for end in reversed(ends):
        try:
            return len(data[:end].decode())
        except UnicodeDecodeError:  # a token that ends inside a character
            continue
    return 0


def _split(logprobs: list[Logprobs], size: int) -> tuple[list[Logprobs], list[Logprobs]]:
    """The logprobs of the first ``size`` bytes of their text, and those of the rest: a token goes with the part
    its last byte is in."""
    sent: list[Logprobs] = []
    kept: list[Logprobs] = []
    for group in logprobs:
        count = 0
        for item in group.items:
            if kept or len(item.token) > size:
                break
            size -= len(item.token)
            count += 1
        if count:
            sent.append(group if count == len(group.items) else Logprobs(group.items[:count]))
        if count < len(group.items):
            kept.append(group if not count else Logprobs(group.items[count:]))
    return sent, kept


@dataclass
class _StepOutcome:
    server_calls: list[ToolCallPiece] = field(default_factory=list)
    external_call: bool = False
    refused: bool = False
    finish_reason: str = "stop"
