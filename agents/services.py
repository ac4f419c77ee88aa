"""Workflows of the agent runtime: a turn (tenant's instance, stored history, admission, the stream, usage,
storage), the instances a tenant may use, feedback, and pruning stored conversations."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import orjson
from django.conf import settings
from django.db import transaction
from django.db.models import Count, Exists, Max, OuterRef, Sum
from django.utils import timezone
from pydantic import ValidationError

from core.db import db_task
from inference.engine import capabilities
from inference.openai import responses as wire
from inference.openai.errors import SERVER, APIError, invalid_request, model_missing
from inference.openai.shared import declared_fields
from inference.serving import responses
from inference.serving.caller import (
    Caller,
    Result,
    admit_request,
    charge_within,
    check_output_limit,
    least_charge,
    meter_for,
    precheck_request,
)
from inference.serving.metered import Metered

from . import runtime
from .guardrails import Guardrails
from .models import AgentInstance, Feedback, StoredResponse
from .protocol import AGENT_CALL, AgentCall, AgentResponseRequest, storable, unstorable, unstorable_at
from .runtime import Agent, AgentTurn
from .tools.registry import REGISTRY, ToolContext

ENDPOINT = "agents.responses"
ROUTE = "agent"
PRUNE_EVERY_SECONDS = 3600.0


# --- instances -------------------------------------------------------------------------------------


def list_instances(*, organization_id: int) -> list[AgentInstance]:
    return list(AgentInstance.objects.usable_by(organization_id).select_related("model"))


def model_not_found(instance_id: str) -> APIError:
    return model_missing(
        f"The model {instance_id!r} does not exist or you do not have access to it.", code="model_not_found"
    )


def load_agent(*, instance_id: str, organization_id: int) -> Agent:
    instance = (
        AgentInstance.objects.usable_by(organization_id).select_related("model").filter(instance_id=instance_id).first()
    )
    if instance is None:
        held = AgentInstance.objects.filter(instance_id=instance_id, enabled=True, organizations__id=organization_id)
        if held.exists():  # the tenant's instance, on a catalog model switched off for now
            raise APIError(
                f"The model {instance_id!r} is not available right now: the model it runs on is disabled.",
                code="model_not_available",
                status=503,
                type=SERVER,
                headers={"Retry-After": str(settings.OUTAGE_RETRY_AFTER_SECONDS)},
            )
        raise model_not_found(instance_id)
    return Agent(
        pk=instance.pk,
        instance_id=instance.instance_id,
        entry=instance.model,
        instructions=instance.instructions,
        tools=tuple(REGISTRY[name] for name in instance.tools if name in REGISTRY),
        first_step=instance.first_step,
        reasons=instance.reasons,
        guardrails=Guardrails.of(instance.guardrails.all()),
        temperature=instance.temperature,
        max_output_tokens=instance.max_output_tokens,
    )


# --- stored conversations ------------------------------------------------------------------------------


def _retention_cutoff() -> datetime | None:
    days = settings.AGENT_RESPONSE_RETENTION_DAYS
    return timezone.now() - timedelta(days=days) if days else None


def find_stored(*, response_id: str, organization_id: int) -> StoredResponse | None:
    """The tenant's stored response, unless its conversation is past the retention period (pruned or not yet):
    a conversation is kept, every turn of it, until its last turn is that old."""
    found = StoredResponse.objects.filter(response_id=response_id, organization_id=organization_id)
    if (cutoff := _retention_cutoff()) is not None:
        found = found.filter(Exists(StoredResponse.objects.filter(thread=OuterRef("thread"), created__gte=cutoff)))
    return found.first()


def previous_not_found(response_id: str) -> APIError:
    days = settings.AGENT_RESPONSE_RETENTION_DAYS
    kept = f"for {days} days" if days else "until deleted"
    return invalid_request(
        f"Previous response with id {response_id!r} not found. Only responses created with store: true are kept, "
        f"{kept}, from the moment they end (a response still streaming cannot be continued yet), and a conversation "
        "goes on with the agent instance (model) it began with; with store: false, send the whole conversation as "
        "input.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def conversation_too_large(detail: str, *, param: str) -> APIError:
    return invalid_request(
        f"{detail} Start a new conversation, or continue with store: false and the items you need as input.",
        param=param,
        code="conversation_too_large",
    )


@dataclass(frozen=True, slots=True)
class History:
    """A stored response, the items of its conversation up to and including it (oldest first), and what the
    whole conversation holds, all its branches together."""

    last: StoredResponse
    items: list[dict[str, Any]]
    turns: int
    size: int  # bytes of stored items

    def check_room(self, *, adding: int) -> None:
        """Refuses a new turn of ``adding`` bytes that the conversation has no room for."""
        if self.turns >= settings.AGENT_CONVERSATION_MAX_TURNS:
            raise conversation_too_large(
                f"The conversation of {self.last.response_id!r} holds {self.turns} stored turns, the most one "
                "conversation may hold.",
                param="previous_response_id",
            )
        if self.size + adding > settings.AGENT_CONVERSATION_MAX_BYTES:
            raise conversation_too_large(
                f"The conversation of {self.last.response_id!r} holds {self.size} bytes of items; with this input's "
                f"{adding} it would pass the {settings.AGENT_CONVERSATION_MAX_BYTES} one conversation may hold.",
                param="input",
            )


def load_history(*, response_id: str, organization_id: int, instance_pk: int) -> History:
    """The conversation up to ``response_id``: only that branch's items are read, and at most
    ``AGENT_CONVERSATION_MAX_TURNS`` turns are looked at. A conversation goes on with the instance it was held with:
    another instance's model would read what this one's tools found (its knowledge), and an organization that has
    lost the instance, or an instance disabled, ends its conversations."""
    last = find_stored(response_id=response_id, organization_id=organization_id)
    if last is None or last.instance_id != instance_pk:
        raise previous_not_found(response_id)
    most = settings.AGENT_CONVERSATION_MAX_TURNS
    rows = StoredResponse.objects.filter(thread=last.thread, organization_id=organization_id)
    links = {pk: (previous, size) for pk, previous, size in rows.values_list("pk", "previous_id", "size")[: most + 1]}
    if len(links) > most:
        raise conversation_too_large(
            f"The conversation of {response_id!r} holds more than {most} stored turns.", param="previous_response_id"
        )
    chain: list[int] = []
    pk: int | None = last.pk
    while pk is not None and pk in links:
        chain.append(pk)
        pk = links[pk][0]
    turns = StoredResponse.objects.only("input_items", "output_items").in_bulk(chain)
    items = [item for pk in reversed(chain) for item in (*turns[pk].input_items, *turns[pk].output_items)]
    return History(last=last, items=items, turns=len(links), size=sum(size for _, size in links.values()))


def stored_size(*item_lists: list[dict[str, Any]]) -> int:
    """The bytes items take when stored, as JSON."""
    return sum(len(orjson.dumps(items)) for items in item_lists)


_last_prune = 0.0


def keep_response(
    *,
    response: dict[str, Any],
    organization_id: int,
    instance_pk: int,
    api_key_id: int | None,
    previous: StoredResponse | None,
    input_items: list[dict[str, Any]],
    request_id: str,
) -> StoredResponse:
    global _last_prune
    if time.monotonic() - _last_prune > PRUNE_EVERY_SECONDS:
        # Embedded mode has no Celery beat: whoever stores prunes, at most hourly per process.
        _last_prune = time.monotonic()
        prune_responses()
    # The client's input was checked before the turn ran; the output is the model's.
    output = storable(response["output"]) if unstorable_at(response["output"], "output") else response["output"]
    size = stored_size(input_items, output)
    with transaction.atomic():
        if previous is not None:
            _check_room_to_store(thread=previous.thread, organization_id=organization_id, adding=size)
            # Locked, so that it is not deleted (a prune, an operator) between this look and the row that links to it.
            if not StoredResponse.objects.select_for_update().filter(pk=previous.pk).exists():
                raise invalid_request(
                    f"The response {previous.response_id!r} this one continues was deleted while it ran; this "
                    "response was not stored.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
        return StoredResponse.objects.create(
            response_id=response["id"],
            organization_id=organization_id,
            instance_id=instance_pk,
            api_key_id=api_key_id,
            previous=previous,
            thread=previous.thread if previous is not None else response["id"],
            status=response["status"],
            input_items=input_items,
            output_items=output,
            size=size,
            usage=response.get("usage") or {},
            request_id=request_id,
        )


def _check_room_to_store(*, thread: str, organization_id: int, adding: int) -> None:
    """The turn cap and the size cap, checked again as the turn is stored: the conversation's first turn is
    locked until the transaction ends, so turns of one conversation stored at once are counted one after
    another (checked only before they ran, concurrent continuations all passed)."""
    conversation = StoredResponse.objects.filter(thread=thread, organization_id=organization_id)
    list(conversation.filter(response_id=thread).select_for_update().values_list("pk"))
    held = conversation.aggregate(turns=Count("pk"), size=Sum("size"))
    if held["turns"] >= settings.AGENT_CONVERSATION_MAX_TURNS:
        raise conversation_too_large(
            f"The conversation holds {held['turns']} stored turns, the most one conversation may hold; this "
            "response was not stored.",
            param="previous_response_id",
        )
    if (held["size"] or 0) + adding > settings.AGENT_CONVERSATION_MAX_BYTES:
        raise conversation_too_large(
            f"The conversation holds {held['size']} bytes of items; with this response's {adding} it would pass "
            f"the {settings.AGENT_CONVERSATION_MAX_BYTES} one conversation may hold; this response was not stored.",
            param="previous_response_id",
        )


def prune_responses() -> int:
    """Deletes the conversations whose last turn is older than ``AGENT_RESPONSE_RETENTION_DAYS``."""
    cutoff = _retention_cutoff()
    if cutoff is None:
        return 0
    stale = (
        StoredResponse.objects.values("thread").annotate(last=Max("created")).filter(last__lt=cutoff).values("thread")
    )
    deleted, by_model = StoredResponse.objects.filter(thread__in=stale).delete()
    return by_model.get(StoredResponse._meta.label, 0)


# --- a turn -----------------------------------------------------------------------------------------


def input_items(params: AgentResponseRequest) -> list[dict[str, Any]]:
    """This turn's input as items (a string is one user message) with only their declared fields, and replayed
    server tool calls checked."""
    if isinstance(params.input, str):
        return [{"type": "message", "role": "user", "content": params.input}]
    items = []
    for index, item in enumerate(params.input):
        # Only the fields the runtime knows are kept: anything else would be stored at no token cost.
        data = declared_fields(item)
        if isinstance(item, wire.OtherItem) and item.type == AGENT_CALL:
            try:
                data = declared_fields(AgentCall.model_validate(item.model_dump(mode="json")))
            except ValidationError as exc:
                first = exc.errors(include_url=False)[0]
                where = ".".join(str(part) for part in (f"input.{index}", *first["loc"]))
                raise invalid_request(
                    f"Invalid {AGENT_CALL} item at {where}: {first['msg']}.", param=where, code="invalid_value"
                ) from None
        items.append(data)
    return items


def _check_not_in_history(params: AgentResponseRequest, history: list[dict[str, Any]]) -> None:
    """An item of the conversation sent again with ``previous_response_id`` would be read twice, and kept twice."""
    kept = {item_id for item in history if isinstance(item_id := item.get("id"), str)}
    for _, item_id in params.echoed_ids():
        if item_id in kept:
            raise wire.duplicate_item(item_id)


def _check_replayed_calls(items: list[dict[str, Any]], agent: Agent) -> None:
    """A server tool's run sent back must be of a tool the instance runs: the model reads the runs as the context of
    its system message, and a run of a tool that no instance of it runs can only have been written by the client."""
    for index, item in enumerate(items):
        if item.get("type") == AGENT_CALL and agent.tool(item["name"]) is None:
            runs = ", ".join(repr(tool.name) for tool in agent.tools) or "none"
            raise invalid_request(
                f"{item['name']!r} is not a tool this instance runs (it runs {runs}): send back the server tools' "
                "runs as the response gave them, or leave them out.",
                param=f"input.{index}.name",
                code="invalid_value",
            )


def _check_storable(params: AgentResponseRequest, items: list[dict[str, Any]]) -> None:
    """Refuses, before the turn runs, input a stored turn cannot hold (as stored, it would fail only at the end)."""
    where = unstorable_at(params.input if isinstance(params.input, str) else items, "input")
    if where is not None:
        message = f"{unstorable(where)}: remove it, or send store: false."
        raise invalid_request(message, param=where, code="invalid_value")


# Bytes of stored input a turn may keep for each token of its model's context: more than its prompt could hold (a
# token carries a few bytes), so that input the model never reads (a reasoning item's summary, an earlier tool run
# past its share of the context) is not stored at no token cost.
STORED_BYTES_PER_CONTEXT_TOKEN = 16


def _check_turn_size(items: list[dict[str, Any]], agent: Agent) -> None:
    most = agent.entry.context_length * STORED_BYTES_PER_CONTEXT_TOKEN
    if (size := stored_size(items)) > most:
        raise conversation_too_large(
            f"This input's {size} bytes of items pass the {most} a stored turn may hold on {agent.entry.public_id} "
            f"({STORED_BYTES_PER_CONTEXT_TOKEN} bytes for each token of its {agent.entry.context_length}-token "
            "context): send less, or send store: false.",
            param="input",
        )


def _check_against_instance(params: AgentResponseRequest, agent: Agent) -> None:
    for index, tool in enumerate(params.function_tools):
        if agent.tool(tool.name) is not None:
            raise invalid_request(
                f"The instance runs a tool named {tool.name!r} itself: give yours another name.",
                param=f"tools.{index}.name",
                code="invalid_value",
            )
    if params.tool_choice == "required" and not params.function_tools and not agent.tools:
        raise invalid_request(
            "tool_choice 'required' needs at least one tool: the instance runs none, and the request sends none.",
            param="tool_choice",
            code="invalid_value",
        )
    if params.tool_choice == "required" and not params.function_tools and params.max_tool_calls == 0:
        raise invalid_request(
            "tool_choice 'required' cannot be met: max_tool_calls 0 lets the instance's tools run no call, and the "
            "request sends no tools of its own.",
            param="tool_choice",
            code="invalid_value",
        )
    check_output_limit(agent.entry, params.max_output_tokens)
    # The agent's capabilities are its model's, with reasoning only when the instance reasons too.
    entry = agent.entry
    capabilities.check(
        model_id=agent.instance_id,
        offers={**entry.capabilities(), "reasoning": agent.reasons and entry.reasoning},
        tools=bool(params.function_tools),
        reasoning_effort=params.reasoning_effort,
        images=params.param_names().image is not None,
    )


def _echo(params: AgentResponseRequest, agent: Agent) -> dict[str, Any]:
    """The request's settings as applied: with the instance's defaults where the request set none."""
    echo = responses.echo(params)
    applied = runtime.temperature(params, agent)
    defaults = agent.entry.sampling_defaults
    echo.update(
        store=params.keeps,
        previous_response_id=params.previous_response_id,
        max_output_tokens=runtime.output_limit(params, agent),
        temperature=float(defaults.get("temperature", 1.0)) if applied is None else applied,
        top_p=float(defaults.get("top_p", 1.0)) if params.top_p is None else params.top_p,
    )
    return echo


_load_agent = db_task(load_agent)
_load_history = db_task(load_history)
_keep_response = db_task(keep_response)


async def create_response(*, params: AgentResponseRequest, caller: Caller) -> Result:
    """Check and resolve everything that can still be answered with a plain error, admit, then stream."""
    params.refuse_unsupported()
    organization_id = caller.organization_id
    agent = await _load_agent(instance_id=params.model, organization_id=organization_id)
    _check_against_instance(params, agent)
    items = input_items(params)
    _check_replayed_calls(items, agent)
    if params.keeps:
        _check_storable(params, items)
        _check_turn_size(items, agent)
    previous: StoredResponse | None = None
    history: list[dict[str, Any]] = []
    if params.previous_response_id is not None:
        found = await _load_history(
            response_id=params.previous_response_id, organization_id=organization_id, instance_pk=agent.pk
        )
        if params.keeps:
            found.check_room(adding=stored_size(items))
        previous, history = found.last, found.items
        _check_not_in_history(params, history)
    elif params.keeps and (size := stored_size(items)) > settings.AGENT_CONVERSATION_MAX_BYTES:
        raise conversation_too_large(
            f"This input's {size} bytes of items pass the {settings.AGENT_CONVERSATION_MAX_BYTES} one conversation "
            "may hold.",
            param="input",
        )

    async def keep(response: dict[str, Any]) -> None:
        await _keep_response(
            response=response,
            organization_id=organization_id,
            instance_pk=agent.pk,
            api_key_id=caller.api_key.pk,
            previous=previous,
            input_items=items,
            request_id=caller.request_id,
        )

    turn = AgentTurn(
        agent=agent,
        params=params,
        history=history,
        input_items=items,
        encoder=responses.ResponseEncoder(echo=_echo(params, agent)),
        context=ToolContext(instance_pk=agent.pk, organization_id=organization_id),
        keep=keep if params.keeps else None,
        request_id=caller.request_id,
        api_key_id=caller.api_key.pk,
    )
    meter = meter_for(caller, model=agent.entry.public_id, endpoint=ENDPOINT, route=ROUTE)
    least = least_charge(agent.entry, runtime.output_limit(params, agent))
    await precheck_request(caller, meter, model_pk=agent.entry.pk, tokens=least)
    first = await turn.prepare_first()
    # Admitted as any request, on the first step's prompt and the whole output budget; later steps' prompts,
    # which hold tool results, are charged as they are built, and only if they fit: a step that would take the
    # organization past its tokens per minute fails the response with the rate-limit error instead. A turn the input
    # guardrails refused runs no model: it counts as a request, and charges no tokens.
    tokens = 0 if turn.refused else first.prompt_tokens + first.job.sampling.max_tokens
    grant = await admit_request(caller, meter, model_pk=agent.entry.pk, tokens=tokens)
    turn.charge = charge_within(grant, meter)
    stream = Metered(turn.events(), grant=grant, meter=meter, outcome=lambda _: turn.outcome(started=meter.started))
    return Result(headers=grant.headers, stream=stream, route=ROUTE)


# --- feedback ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rated:
    message_id: str
    feedback: Feedback


def rate_response(
    *, organization_id: int, api_key_id: int | None, message_id: str, rating: str, comment: str, meta: dict[str, Any]
) -> Rated:
    response = find_stored(response_id=message_id, organization_id=organization_id)
    if response is None:
        raise APIError(
            f"No stored response with id {message_id!r}. Only responses created with store: true can be rated.",
            code="response_not_found",
            status=404,
            param="meta.message_id",
        )
    feedback, _ = Feedback.objects.update_or_create(
        response=response,
        defaults={
            "rating": rating,
            "comment": comment,
            "meta": meta,
            "api_key_id": api_key_id,
            "created": timezone.now(),
        },
    )
    return Rated(message_id=message_id, feedback=feedback)
