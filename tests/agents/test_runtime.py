"""What the model reads of a conversation's server tool runs, without a model to run: each document once, this turn's
runs whole, and earlier turns' runs within their share of the context, the oldest giving way."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from agents.models import AgentInstance, Document
from agents.protocol import agent_call_item
from agents.runtime import tool_context
from agents.tools.knowledge import knowledge_search
from agents.tools.registry import ToolContext
from inference.engine.decoding import new_call_id

pytestmark = pytest.mark.django_db(transaction=True)

HEADER = "Results of the tools run for this conversation:\n"


@pytest.fixture
def parts_catalog(make_instance: Callable[..., AgentInstance]) -> AgentInstance:
    """A document for each of the parts 100 to 159, found by its number."""
    instance = make_instance("support.agent.catalog", tools=["knowledge_search"])
    for number in range(100, 160):
        Document.objects.create(
            instance=instance,
            title=f"Part {number}",
            url=f"https://docs.example.com/parts/{number}",
            text=f"Part {number} fits the machines of series {number}. It is made of steel and lasts ten years.",
        )
    return instance


def searched(instance: AgentInstance, query: str) -> dict[str, Any]:
    """A knowledge search the service ran, as a turn stores it."""
    result = knowledge_search(ToolContext(instance_pk=instance.pk, organization_id=0), {"query": query})
    return agent_call_item(
        item_id="atc_1",
        status="completed",
        call_id=new_call_id(),
        name="knowledge_search",
        arguments=json.dumps({"query": query}),
        output=result.output,
    )


def queries(context: str) -> list[str]:
    """The queries of the searches a context gives, in its order."""
    return [
        json.loads(line.split(" ", 1)[1].removesuffix(":"))["query"]
        for line in context.splitlines()
        if line.startswith("knowledge_search {")
    ]


def test_a_conversations_first_turn_reads_its_runs_whole_as_they_ran(parts_catalog: AgentInstance) -> None:
    first, second = searched(parts_catalog, "100 101"), searched(parts_catalog, "102")
    failed = agent_call_item(
        item_id="atc_2", status="failed", call_id=new_call_id(), name="check_stock", arguments="{}", error="Down."
    )

    context = tool_context([], [first, second, failed], budget=0)

    assert context == HEADER + "\n\n".join(
        [
            f'knowledge_search {{"query": "100 101"}}:\n{first["output"]}',
            f'knowledge_search {{"query": "102"}}:\n{second["output"]}',
            "check_stock {}:\nFailed: Down.",
        ]
    )


def test_a_document_found_again_is_given_once_with_the_latest_run_that_found_it(parts_catalog: AgentInstance) -> None:
    earlier = [searched(parts_catalog, "100"), searched(parts_catalog, "101 100"), searched(parts_catalog, "102")]

    context = tool_context(earlier, [searched(parts_catalog, "100")], budget=10_000)

    assert context.count("(https://docs.example.com/parts/100)") == 1
    # The first search found only what the last found again; the second keeps the document only it found.
    assert queries(context) == ["101 100", "102", "100"]
    assert context.count("(https://docs.example.com/parts/101)") == 1


def test_the_same_result_of_the_same_run_is_given_once() -> None:
    def unreachable() -> dict[str, Any]:
        return agent_call_item(
            item_id="atc_1", status="failed", call_id=new_call_id(), name="check_stock", arguments="{}", error="Down."
        )

    context = tool_context([unreachable(), unreachable()], [unreachable()], budget=10_000)

    assert context == HEADER + "check_stock {}:\nFailed: Down."


def test_earlier_turns_runs_give_way_oldest_first_to_stay_within_their_budget(parts_catalog: AgentInstance) -> None:
    earlier = [searched(parts_catalog, str(number)) for number in range(100, 159)]
    this_turn = searched(parts_catalog, "159")
    budget = 1_000

    context = tool_context(earlier, [this_turn], budget=budget)

    kept = queries(context)
    assert kept[-1] == "159" and this_turn["output"] in context
    # The latest earlier runs, as many as the budget holds, and none older.
    assert 1 < len(kept) - 1 < len(earlier)
    assert kept[:-1] == [str(number) for number in range(159 - len(kept) + 1, 159)]
    assert len(context) - len(tool_context([], [this_turn], budget=0)) <= budget
    assert len(tool_context(earlier, [this_turn], budget=budget + 200)) > len(context)


def test_this_turns_runs_are_given_whole_whatever_the_budget(parts_catalog: AgentInstance) -> None:
    this_turn = [searched(parts_catalog, "100 101 102"), searched(parts_catalog, "103")]

    context = tool_context([searched(parts_catalog, "104")], this_turn, budget=0)

    assert queries(context) == ["100 101 102", "103"]
