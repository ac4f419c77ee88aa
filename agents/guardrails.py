"""An instance's guardrails, loaded once per request: which text they block, and what the user is told.

Patterns are admins' regular expressions, and some of them backtrack for ever on the wrong text. Matching
runs with the ``regex`` module's timeout, on threads of its own with the GIL released, so a slow pattern
neither blocks the event loop nor holds the threads that authenticate requests; a check that runs out of
time (``AGENT_GUARDRAIL_TIMEOUT_MS`` for all the rules and texts of one check) counts as a match, because a
guardrail that cannot say no must not say yes. For the same reason a guardrail whose expression does not
compile (saved past the admin's check, or refused by a newer ``regex``) refuses every text it checks, and says
so in the log, rather than failing the request or letting everything through.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import unicodedata
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import regex
from django.conf import settings

from agents.models import COMPILE_ERRORS, Guardrail

logger = logging.getLogger("agents.guardrails")

_threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="guardrails")


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    patterns: tuple[Any, ...] | None  # compiled ``regex`` patterns, any of which blocks; None: they do not compile
    refusal: str

    @classmethod
    def of(cls, guardrail: Guardrail) -> Rule:
        try:
            patterns = guardrail.compiled()
        except COMPILE_ERRORS as exc:
            logger.error("guardrail %r does not compile (%s): it refuses every text it checks", guardrail.name, exc)
            patterns = None
        return cls(guardrail.name, patterns, guardrail.refusal)


@dataclass(frozen=True, slots=True)
class Guardrails:
    on_input: tuple[Rule, ...] = ()
    on_output: tuple[Rule, ...] = ()

    @classmethod
    def of(cls, guardrails: Iterable[Guardrail]) -> Guardrails:
        rules = [(g, Rule.of(g)) for g in guardrails if g.enabled and g.lines()]
        return cls(
            on_input=tuple(rule for g, rule in rules if g.checks("input")),
            on_output=tuple(rule for g, rule in rules if g.checks("output")),
        )

    async def check_input(self, texts: Sequence[str]) -> Rule | None:
        return await _first_match(self.on_input, texts)

    async def check_output(self, text: str) -> Rule | None:
        return await _first_match(self.on_output, [text])


async def _first_match(rules: tuple[Rule, ...], texts: Sequence[str]) -> Rule | None:
    texts = [text for text in texts if text]
    if not rules or not texts:
        return None
    return await asyncio.get_running_loop().run_in_executor(_threads, _search, rules, texts)


# Characters that show nothing (soft hyphens, zero-width spaces, word joiners, variation selectors, fillers): a reader
# and the model read across them.
_INVISIBLE = regex.compile(r"[\p{Cf}\p{Default_Ignorable_Code_Point}]+")
# Marks drawn on a letter (an accent, a stroke through it): the letter stays the letter to a reader.
_MARKS = regex.compile(r"\p{M}+")


def as_read(text: str) -> str:
    """Text as the guardrails match it: in compatibility form (fullwidth letters are letters, a no-break space is a
    space), without characters that show nothing. Written so, a blocked word reaches the model whole all the same."""
    return _INVISIBLE.sub("", unicodedata.normalize("NFKC", text))


def _readings(text: str) -> list[str]:
    """``text`` as read, and, where it holds characters that show nothing, read with each as a space too: between
    two words (``credit<zero-width space>card``) one stands for the space a reader sees no less than the model.
    Where marks are drawn on its letters (``pásswórd``, a struck-through ``p̶a̶s̶s̶``), each reading is read once more
    without them. Where it holds letters of another script that look like ASCII ones (a Cyrillic ``а`` in
    ``pаssword``), each reading is read once more with them as the letters they look like."""
    joined = as_read(text)
    readings = [joined]
    if _INVISIBLE.search(text):
        readings.append(_INVISIBLE.sub(" ", unicodedata.normalize("NFKC", text)))
    if _MARKS.search(unicodedata.normalize("NFD", joined)):
        readings += [_MARKS.sub("", unicodedata.normalize("NFD", reading)) for reading in readings]
    if not joined.isascii():
        look_alikes = _look_alikes()
        readings += [seen for reading in readings if (seen := reading.translate(look_alikes)) != reading]
    return readings


@functools.cache
def _look_alikes() -> dict[int, str]:
    """Each character that Unicode's confusables list as looking like one ASCII letter or digit, mapped to it."""
    from confusable_homoglyphs.confusables import confusables_data

    table: dict[int, str] = {}
    for char, glyphs in confusables_data.items():
        alike = {g["c"] for g in glyphs if len(g["c"]) == 1 and g["c"].isascii() and g["c"].isalnum()}
        if len(char) == 1 and not char.isascii() and len(alike) == 1:
            table[ord(char)] = alike.pop()
    return table


def _search(rules: tuple[Rule, ...], texts: list[str]) -> Rule | None:
    deadline = time.monotonic() + settings.AGENT_GUARDRAIL_TIMEOUT_MS / 1000
    texts = [reading for text in texts for reading in _readings(text)]
    for rule in rules:
        if rule.patterns is None:
            return rule
        for pattern in rule.patterns:
            for text in texts:
                try:
                    found = pattern.search(text, timeout=max(deadline - time.monotonic(), 0.001), concurrent=True)
                except TimeoutError:
                    logger.warning(
                        "guardrail %r ran out of time on a text of %d characters: refused", rule.name, len(text)
                    )
                    return rule
                if found is not None:
                    return rule
    return None
