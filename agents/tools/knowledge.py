"""The built-in server tools; importing this module registers them (``agents.apps`` does, when the app is ready)."""

from __future__ import annotations

import re
from typing import Any

from .registry import ServerTool, Source, ToolContext, ToolError, ToolResult, register
from .search import query_terms, search_documents

SEARCH_RESULTS = 3
# A query is a few words: bounded, so that a model sampling hot cannot spend the response's tokens on it (the
# grammar of a forced call holds the model to it). The search the runtime runs first takes the user's text whole.
QUERY_MAX_CHARACTERS = 128
# A document in a search's output (``knowledge_search`` writes them so): "[1] Title (URL)", its excerpt on the next
# line (whitespace made single spaces), a blank line before the next.
FOUND_DOCUMENT = re.compile(r"\[\d+\] (?P<document>[^\n]* \(\S*\))\n")


def knowledge_search(context: ToolContext, arguments: dict[str, Any]) -> ToolResult:
    query = arguments.get("query")
    if not isinstance(query, str) or not query.strip():
        raise ToolError("knowledge_search needs a query: the words to search for.")
    if not query_terms(query):
        raise ToolError(f"The query {query!r} has no words to search for.")
    hits = search_documents(instance_id=context.instance_pk, query=query, limit=SEARCH_RESULTS)
    if not hits:
        return ToolResult(output="No documents match.")
    # Plain text, read by the model as context and shown to the user as the tool's result.
    found = [f"[{number}] {hit.title} ({hit.url})\n{hit.excerpt}" for number, hit in enumerate(hits, 1)]
    return ToolResult(output="\n\n".join(found), sources=tuple(Source(title=hit.title, url=hit.url) for hit in hits))


def found_documents(output: str) -> list[tuple[str | None, str]]:
    """A search's output as what it found: each document's text, with its title and URL, which name the document
    whatever excerpt a query drew from it; ``None`` for text that names no document ("No documents match.")."""
    parts = []
    for part in output.split("\n\n"):
        found = FOUND_DOCUMENT.match(part)
        parts.append((found["document"] if found is not None else None, part))
    return parts


KNOWLEDGE_SEARCH = register(
    ServerTool(
        name="knowledge_search",
        description="Search the knowledge base for documents about the user's question.",
        parameters={
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": QUERY_MAX_CHARACTERS}},
            "required": ["query"],
        },
        run=knowledge_search,
    )
)
