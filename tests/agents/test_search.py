"""The knowledge search: SQLite's FTS5 index (what the tests' database has), the portable fallback, excerpts,
and the knowledge_search tool's results and failures."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agents.models import AgentInstance, Document
from agents.tools import search
from agents.tools.knowledge import KNOWLEDGE_SEARCH
from agents.tools.registry import ToolContext, ToolError

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def parts(make_instance: Callable[..., AgentInstance]) -> AgentInstance:
    return make_instance("support.agent.parts", documents=True)


def titles(instance: AgentInstance, query: str, *, limit: int = 3) -> list[str]:
    return [hit.title for hit in search.search_documents(instance_id=instance.pk, query=query, limit=limit)]


def test_the_test_database_searches_with_fts5() -> None:
    assert search.fts5_index_exists()


def test_it_finds_documents_by_their_rarer_words_and_ranks_title_matches_first(parts: AgentInstance) -> None:
    assert titles(parts, "How do I replace the drive belts?")[0] == "Replacing the B-220 drive belt"
    assert titles(parts, "filter service intervals") == [
        "C-31 filter cartridge: service intervals",
        "Machine 4711: compatible spare parts",
    ]
    assert titles(parts, "What is it?") == []  # only common words
    assert titles(parts, "zeppelin") == []


def test_it_searches_only_the_instances_own_documents(
    parts: AgentInstance, make_instance: Callable[..., AgentInstance]
) -> None:
    other = make_instance("other.agent")
    Document.objects.create(
        instance=other, title="Drive belt catalogue", url="https://other.example/belts", text="Belts."
    )

    assert "Drive belt catalogue" not in titles(parts, "drive belt")
    assert titles(other, "drive belt") == ["Drive belt catalogue"]


def test_the_index_follows_edits_and_deletions(parts: AgentInstance) -> None:
    belt = Document.objects.get(title="Replacing the B-220 drive belt")
    belt.title, belt.text = "Gearbox oil", "Use ISO VG 220 gear oil in the gearbox."
    belt.save()

    assert titles(parts, "gearbox") == ["Gearbox oil"]
    assert "Gearbox oil" not in titles(parts, "pulleys")
    belt.delete()
    assert titles(parts, "gearbox") == []


def test_search_syntax_in_a_query_is_plain_words(parts: AgentInstance) -> None:
    assert titles(parts, 'belt" OR title:* NEAR(')[0] == "Replacing the B-220 drive belt"


def test_the_portable_search_agrees_on_the_best_match(parts: AgentInstance) -> None:
    for query in ["replace the drive belts", "filter service intervals", "Which parts fit machine 4711?"]:
        terms = search.query_terms(query)
        portable = search._portable(parts.pk, terms, 3)
        assert portable[0].title == titles(parts, query)[0]


def test_an_excerpt_is_bounded_and_shows_where_the_words_are() -> None:
    text = "Intro. " * 100 + "The C-31 filter is changed every 500 hours. " + "Outro. " * 100

    excerpt = search.excerpt(text, ["filter"])

    assert len(excerpt) <= search.EXCERPT_CHARS + 2 and "C-31 filter is changed" in excerpt
    assert excerpt.startswith("…") and excerpt.endswith("…")


def test_the_knowledge_search_tool_lists_titles_urls_and_excerpts_and_names_its_sources(parts: AgentInstance) -> None:
    result = KNOWLEDGE_SEARCH.run(ToolContext(instance_pk=parts.pk, organization_id=0), {"query": "drive belt"})

    assert result.output.startswith(
        "[1] Replacing the B-220 drive belt (https://docs.example.com/parts/b-220/replacement)\nSwitch machine 4711 off"
    )
    assert [source.url for source in result.sources][0] == "https://docs.example.com/parts/b-220/replacement"


@pytest.mark.parametrize(("query", "message"), [("", "needs a query"), ("?!", "has no words to search for")])
def test_the_knowledge_search_tool_fails_on_a_query_without_words(
    parts: AgentInstance, query: str, message: str
) -> None:
    with pytest.raises(ToolError, match=message):
        KNOWLEDGE_SEARCH.run(ToolContext(instance_pk=parts.pk, organization_id=0), {"query": query})
