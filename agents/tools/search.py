"""Full-text search over an instance's documents, in the database.

SQLite: an FTS5 index (``agents_document_fts``, kept in step with the documents by triggers, see the
migration) ranked by BM25 with titles weighted double. PostgreSQL: ``to_tsvector`` / ``ts_rank`` with
titles weighted A. Anything else, or an SQLite built without FTS5: each document's words are matched
in Python, which is fine for the few hundred documents an instance holds. The query's words are
OR-ed (minus common English words), so a question finds the documents that share its rarer words.
"""

from __future__ import annotations

import functools
import operator
import re
from dataclasses import dataclass

from django.db import connection

from agents.models import Document

FTS_TABLE = "agents_document_fts"
EXCERPT_CHARS = 400
FALLBACK_MAX_DOCUMENTS = 1000

STOPWORDS = frozenset(
    """a an and are as at be by can could do does for from has have how i in is it its me my no not of on or our
    please should so than that the their them then there these they this to was we were what when where which who
    why will with would you your""".split()
)


@dataclass(frozen=True, slots=True)
class Hit:
    title: str
    url: str
    excerpt: str


def query_terms(query: str) -> list[str]:
    words = re.findall(r"\w+", query.lower())
    return list(dict.fromkeys(word for word in words if word not in STOPWORDS))


def search_documents(*, instance_id: int, query: str, limit: int) -> list[Hit]:
    """The documents of the instance that best match the query's words, best first."""
    terms = query_terms(query)
    if not terms:
        return []
    if connection.vendor == "sqlite" and fts5_index_exists():
        documents = _sqlite_fts5(instance_id, terms, limit)
    elif connection.vendor == "postgresql":
        documents = _postgres(instance_id, terms, limit)
    else:
        documents = _portable(instance_id, terms, limit)
    return [Hit(title=d.title, url=d.url, excerpt=excerpt(d.text, terms)) for d in documents]


def fts5_index_exists() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = %s", [FTS_TABLE])
        return cursor.fetchone() is not None


def _sqlite_fts5(instance_id: int, terms: list[str], limit: int) -> list[Document]:
    # Each word quoted: FTS5 query syntax in a client's words (AND, NEAR, "*", ":") stays plain text.
    match = " OR ".join('"' + term.replace('"', '""') + '"' for term in terms)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT rowid FROM {FTS_TABLE} WHERE {FTS_TABLE} MATCH %s AND instance_id = %s "
            f"ORDER BY bm25({FTS_TABLE}, 2.0, 1.0), rowid LIMIT %s",
            [match, instance_id, limit],
        )
        ids = [row[0] for row in cursor.fetchall()]
    return _in_order(ids)


def _postgres(instance_id: int, terms: list[str], limit: int) -> list[Document]:
    from django.contrib.postgres.search import SearchQuery, SearchRank, SearchVector

    vector = SearchVector("title", weight="A", config="english") + SearchVector("text", weight="B", config="english")
    query = functools.reduce(operator.or_, [SearchQuery(term, config="english") for term in terms])
    found = (
        Document.objects.filter(instance_id=instance_id)
        .annotate(document=vector)
        .filter(document=query)
        .annotate(rank=SearchRank(vector, query))
        .order_by("-rank", "pk")
        .values_list("pk", flat=True)[:limit]
    )
    return _in_order(list(found))


def _portable(instance_id: int, terms: list[str], limit: int) -> list[Document]:
    documents = Document.objects.filter(instance_id=instance_id).order_by("pk")[:FALLBACK_MAX_DOCUMENTS]
    scored = []
    for document in documents:
        title, text = _stems(document.title), _stems(document.text)
        score = sum(2 * (_stem(term) in title) + (_stem(term) in text) for term in terms)
        if score:
            scored.append((-score, document.pk, document))
    return [document for _, _, document in sorted(scored)[:limit]]


def _stem(word: str) -> str:
    """A crude stem for the portable search ("parts" finds "part"); the databases use real stemmers."""
    for suffix in ("ies", "es", "s", "ing", "ed"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)]
    return word


def _stems(text: str) -> set[str]:
    return {_stem(word) for word in re.findall(r"\w+", text.lower())}


def _in_order(ids: list[int]) -> list[Document]:
    by_id = Document.objects.in_bulk(ids)
    return [by_id[pk] for pk in ids if pk in by_id]


def excerpt(text: str, terms: list[str]) -> str:
    """Up to ``EXCERPT_CHARS`` of the text, around the first place one of the terms occurs."""
    text = " ".join(text.split())
    if len(text) <= EXCERPT_CHARS:
        return text
    found = [m.start() for term in terms if (m := re.search(rf"\b{re.escape(_stem(term))}", text, re.IGNORECASE))]
    start = max(0, min(found, default=0) - EXCERPT_CHARS // 4)
    end = min(len(text), start + EXCERPT_CHARS)
    start = max(0, end - EXCERPT_CHARS)
    return ("…" if start else "") + text[start:end].strip() + ("…" if end < len(text) else "")
