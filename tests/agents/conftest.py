"""Agent instances, a tenant's client, and the checks every agent event stream must pass.

``check_stream`` holds the agent API reference's contract: ordering, items, their events, citations,
refusals, failures; events OpenAI's spec has are validated against it, ``agent_runtime:function_call``
items by hand. ``SeedClient`` is a client written from the reference's client checklist, fed the events
shuffled.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.test import AsyncClient

from agents.management.commands.create_demo_instance import DOCUMENTS
from agents.models import AgentInstance, Document, FirstStep, Guardrail, MatchKind, Stage
from inference.models import CatalogEntry
from orgs.models import Organization
from orgs.services import create_api_key
from tests.conftest import OpenAISpec, read_stream
from tests.inference.test_responses import EVENT_SCHEMAS, parse_events

AGENT_CALL = "agent_runtime:function_call"
OPENAI_ITEMS = frozenset({"message", "reasoning", "function_call"})
TERMINAL = ("response.completed", "response.failed")
AGENT_EVENT_SCHEMAS = {
    **EVENT_SCHEMAS,
    "response.output_text.annotation.added": "ResponseOutputTextAnnotationAddedEvent",
    "response.refusal.delta": "ResponseRefusalDeltaEvent",
    "response.refusal.done": "ResponseRefusalDoneEvent",
    "error": "ResponseErrorEvent",
}


# --- instances ------------------------------------------------------------------------------------


@pytest.fixture
def make_instance(organization: Organization, catalog_model: CatalogEntry) -> Callable[..., AgentInstance]:
    """An instance the organization may use; by default on SmolLM2, without tools, knowledge or guardrails."""

    def make(instance_id: str = "test.agent", *, documents: bool = False, **fields: Any) -> AgentInstance:
        fields = {"model": catalog_model, "instructions": "You are a helpful assistant. Answer briefly.", **fields}
        instance = AgentInstance.objects.create(instance_id=instance_id, **fields)
        instance.full_clean()
        instance.organizations.add(organization)
        if documents:
            for title, url, text in DOCUMENTS:
                Document.objects.create(instance=instance, title=title, url=url, text=text)
        return instance

    return make


@pytest.fixture
def spare_parts(make_instance: Callable[..., AgentInstance]) -> AgentInstance:
    """The spare-parts agent: searches its documents first and refuses talk of passwords."""
    instance = make_instance(
        "support.agent.spare-parts",
        documents=True,
        tools=["knowledge_search"],
        first_step=FirstStep.SEARCH,
        instructions="You are the spare-parts assistant. Answer in one sentence from the search results.",
    )
    Guardrail.objects.create(
        instance=instance,
        name="secrets",
        applies_to=Stage.INPUT,
        kind=MatchKind.TERMS,
        patterns="password\ncredit card",
        refusal="I can't help with passwords or payment details.",
    )
    return instance


# --- a tenant's client ------------------------------------------------------------------------------


@dataclass
class Tenant:
    """An organization's client of the agent runtime: its key, and the tenant it names in X-Tenant-ID."""

    key: str
    slug: str
    spec: OpenAISpec
    client: AsyncClient = field(default_factory=AsyncClient)

    def headers(
        self, *, key: str | None = None, tenant: str | None = None, accept: str = "application/json"
    ) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {key or self.key}", "Accept": accept}
        tenant = self.slug if tenant is None else tenant
        if tenant:
            headers["X-Tenant-ID"] = tenant
        return headers

    async def post(self, path: str, body: Any, **who: str | None) -> Any:
        return await self.client.post(
            path, data=json.dumps(body), content_type="application/json", headers=self.headers(**who)
        )

    async def get(self, path: str, **who: str | None) -> Any:
        return await self.client.get(path, headers=self.headers(**who))

    async def stream(self, **body: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """A turn's events, checked against the contract, and its final response."""
        body = {"stream": True, "temperature": 0, **body}
        response = await self.post("/v1/responses", body, accept="text/event-stream")
        assert response.status_code == 200, response.content
        assert response["Content-Type"].startswith("text/event-stream")
        events = parse_events(await read_stream(response))
        return events, check_stream(self.spec, events)


@pytest.fixture
def tenant(api_key: str, organization: Organization, catalog_model: CatalogEntry, openai_spec: OpenAISpec) -> Tenant:
    return Tenant(key=api_key, slug=organization.slug, spec=openai_spec)


@pytest.fixture
def other_tenant(transactional_db: None, openai_spec: OpenAISpec) -> Tenant:
    globex = Organization.objects.create(slug="globex", name="Globex Corp")
    return Tenant(key=create_api_key(organization=globex, name="tests"), slug=globex.slug, spec=openai_spec)


# --- the contract -----------------------------------------------------------------------------------


def _without_agent_items(event: dict[str, Any]) -> dict[str, Any]:
    response = event["response"]
    return {**event, "response": {**response, "output": [i for i in response["output"] if i["type"] != AGENT_CALL]}}


def validate_event(spec: OpenAISpec, event: dict[str, Any]) -> None:
    """Against OpenAI's schema where it has the event; the runtime's own item is checked by ``check_agent_call``."""
    if event["type"].startswith("response.output_item.") and event["item"]["type"] == AGENT_CALL:
        return
    if "response" in event:
        event = _without_agent_items(event)
    spec.validate(AGENT_EVENT_SCHEMAS[event["type"]], event)
    spec.validate("ResponseStreamEvent", event)


def check_agent_call(added: dict[str, Any], done: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """The reference's ``agent_runtime:function_call``: its arguments when it starts (whole JSON, unless the budget cut
    the call short); its output, or its error; and an empty ``content``, for the SDKs that read it as a message."""
    keys = {"id", "type", "status", "call_id", "name", "arguments", "output", "error", "content"}
    assert set(added) == set(done) == keys
    assert added["content"] == done["content"] == []
    assert added["id"].startswith("atc_") and added["status"] == "in_progress"
    if "cut short" not in (done["error"] or ""):
        assert json.loads(added["arguments"]) is not None
    assert (added["id"], added["call_id"], added["name"], added["arguments"]) == (
        done["id"],
        done["call_id"],
        done["name"],
        done["arguments"],
    )
    if done["status"] == "completed":
        assert isinstance(done["output"], str) and done["error"] is None
    else:
        assert (
            done["status"] == "failed" and done["output"] is None and isinstance(done["error"], str) and done["error"]
        )
    assert [e["type"] for e in events] == ["response.output_item.added", "response.output_item.done"]


def check_message(item: dict[str, Any], events: list[dict[str, Any]]) -> None:
    text_part, *rest = item["content"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    (text_done,) = [e for e in events if e["type"] == "response.output_text.done"]
    added = [e["annotation"] for e in events if e["type"] == "response.output_text.annotation.added"]
    assert [e["annotation_index"] for e in events if e["type"] == "response.output_text.annotation.added"] == list(
        range(len(added))
    )
    assert added == text_done["annotations"] == text_part["annotations"]
    assert text_done["text"] == text_part["text"]
    if rest:  # a refusal: the text is emptied, the refusal follows it
        (refusal,) = rest
        assert refusal["type"] == "refusal" and refusal["refusal"]
        assert text_done["text"] == "" and added == []
        (refusal_done,) = [e for e in events if e["type"] == "response.refusal.done"]
        refusal_deltas = "".join(e["delta"] for e in events if e["type"] == "response.refusal.delta")
        assert refusal_deltas == refusal_done["refusal"] == refusal["refusal"]
    else:
        assert deltas == text_done["text"]


def check_stream(spec: OpenAISpec, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rule of the contract a client relies on; returns the final response."""
    for event in events:
        validate_event(spec, event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in TERMINAL and sum(e["type"] in TERMINAL for e in events) == 1
    errors = [index for index, e in enumerate(events) if e["type"] == "error"]
    if events[-1]["type"] == "response.failed":
        assert errors == [len(events) - 2], "a failure is told by one error event, then response.failed"
    else:
        assert errors == []
    response = events[-1]["response"]
    assert {e["response"]["id"] for e in events if "response" in e} == {response["id"]}
    if events[-1]["type"] == "response.completed":
        # A turn ends with its answer, which clients take the last message for, or with calls for the client to run.
        kinds = [item["type"] for item in response["output"]]
        after = kinds[len(kinds) - kinds[::-1].index("message") :] if "message" in kinds else kinds
        assert kinds and (not after or "function_call" in after), f"a turn that ends without its answer: {kinds}"

    added = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.added"}
    done = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert sorted(added) == sorted(done) == list(range(len(done)))
    assert [done[i] for i in range(len(done))] == response["output"]
    for index, item in done.items():
        mine = [e for e in events if e.get("output_index") == index]
        assert mine[0]["type"] == "response.output_item.added" and mine[-1]["type"] == "response.output_item.done"
        assert {e.get("item_id", e.get("item", {}).get("id")) for e in mine} == {item["id"]}
        if item["type"] == AGENT_CALL:
            check_agent_call(added[index], item, mine)
        elif item["type"] == "message":
            check_message(item, mine)
        elif item["type"] == "function_call":
            (arguments,) = [e for e in mine if e["type"] == "response.function_call_arguments.done"]
            assert arguments["arguments"] == item["arguments"]
    return response


# --- a client written from the reference's client checklist -----------------------------------------------------------


@dataclass
class Seen:
    """What a client shows after a stream: the answer, its sources, the refusal, the activity, what to run."""

    text: str = ""
    refusal: str | None = None
    citations: list[tuple[str, str]] = field(default_factory=list)
    activity: list[str] = field(default_factory=list)
    to_run: list[str] = field(default_factory=list)
    keep_id: str | None = None
    failed: bool = False


class SeedClient:
    """Follows the checklist: order by sequence_number, ignore unknown types, items by output_index, show server
    tools without running them, run only function_call items, show refusals, keep the id on completion."""

    def __init__(self, *, knows_agent_calls: bool = True) -> None:
        self.known_items = OPENAI_ITEMS | ({AGENT_CALL} if knows_agent_calls else set())

    def read(self, events: list[dict[str, Any]]) -> Seen:
        shuffled = random.Random(7).sample(events, len(events))
        shuffled.append({"type": "response.vendor_extension.delta", "sequence_number": len(events) - 0.5})
        seen, items, texts = Seen(), {}, {}
        for event in sorted(shuffled, key=lambda e: e["sequence_number"]):
            kind = event["type"]
            if kind in ("response.output_item.added", "response.output_item.done"):
                if event["item"]["type"] in self.known_items:
                    items[event["output_index"]] = event["item"]
            elif kind == "response.output_text.delta" and event["output_index"] in items:
                texts[event["output_index"]] = texts.get(event["output_index"], "") + event["delta"]
            elif kind == "response.output_text.done":
                texts[event["output_index"]] = event["text"]  # replace the buffer with the final text
                seen.citations += [(a["url"], a["title"]) for a in event["annotations"]]
            elif kind == "response.refusal.done":
                seen.refusal = event["refusal"]
                texts[event["output_index"]] = ""  # remove the text shown and show the refusal
            elif kind == "response.completed":
                seen.keep_id = event["response"]["id"]
            elif kind == "response.failed":
                seen.failed = True
        for index in sorted(items):
            item = items[index]
            if item["type"] == AGENT_CALL:
                seen.activity.append(f"{item['name']}: {item['status']}")
            elif item["type"] == "function_call":
                seen.to_run.append(item["name"])
        seen.text = "".join(texts[index] for index in sorted(texts))
        return seen


def message_text(response: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "") for item in response["output"] if item["type"] == "message" for part in item["content"]
    )


def agent_calls(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in response["output"] if item["type"] == AGENT_CALL]
