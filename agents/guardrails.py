"""An instance's guardrails, loaded once per request: which text they block, and what the user is told."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from agents.models import Guardrail


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    pattern: re.Pattern[str]
    refusal: str


@dataclass(frozen=True, slots=True)
class Guardrails:
    on_input: tuple[Rule, ...] = ()
    on_output: tuple[Rule, ...] = ()

    @classmethod
    def of(cls, guardrails: Iterable[Guardrail]) -> Guardrails:
        rules = [(g, Rule(g.name, g.pattern(), g.refusal)) for g in guardrails if g.enabled and g.lines()]
        return cls(
            on_input=tuple(rule for g, rule in rules if g.checks("input")),
            on_output=tuple(rule for g, rule in rules if g.checks("output")),
        )

    def check_input(self, text: str) -> Rule | None:
        return _first_match(self.on_input, text)

    def check_output(self, text: str) -> Rule | None:
        return _first_match(self.on_output, text)


def _first_match(rules: tuple[Rule, ...], text: str) -> Rule | None:
    if text:
        for rule in rules:
            if rule.pattern.search(text):
                return rule
    return None
