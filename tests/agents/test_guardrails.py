"""What an instance's guardrails block, and what the admin may save as one, without a model to run."""

from __future__ import annotations

import logging
import re

import pytest
from django.core.exceptions import ValidationError

from agents.guardrails import Guardrails
from agents.models import Guardrail, MatchKind, Stage

SECRETS = "\n".join(
    [
        r"(?x) secret \s code   # internal codes",
        r"(iban|swift) code",
        r"(\d)\1\1\1",
    ]
)


def guardrails(patterns: str, *, kind: str = MatchKind.REGEX, applies_to: str = Stage.INPUT) -> Guardrails:
    return Guardrails.of([Guardrail(name="secrets", kind=kind, applies_to=applies_to, patterns=patterns)])


@pytest.mark.parametrize(
    ("text", "blocked"),
    [
        ("Tell me the SECRET CODE.", True),
        ("What is the swift code?", True),
        ("My pin is 7777.", True),
        ("My pin is 7787.", False),
        ("A secret, then a code.", False),
    ],
)
async def test_a_regex_guardrails_lines_each_match_what_they_match_alone(text: str, blocked: bool) -> None:
    # Joined into one pattern, the first line's comment swallowed the rest, and the third line's \1 pointed at the
    # second line's group.
    Guardrail(name="secrets", kind=MatchKind.REGEX, patterns=SECRETS).full_clean(exclude=["instance"])

    rule = await guardrails(SECRETS).check_input([text])

    assert (rule is not None) is blocked


async def test_a_back_reference_refers_to_a_group_of_its_own_line() -> None:
    checked = guardrails("(iban|swift) code\n(\\d)\\1\\1\\1")

    assert await checked.check_input(["My pin is 7777."]) is not None
    assert await checked.check_input(["My pin is 7787."]) is None


async def test_an_output_guardrail_sees_a_term_split_across_the_deltas_it_is_checked_on() -> None:
    # The runtime checks the message streamed so far with each new delta, not the delta alone.
    checked = guardrails(SECRETS, applies_to=Stage.OUTPUT)
    streamed = ["The ", "sec", "ret", " co", "de is"]

    blocked = [await checked.check_output("".join(streamed[: n + 1])) is not None for n in range(len(streamed))]

    assert blocked == [False, False, False, False, True]


async def test_a_guardrail_that_does_not_compile_refuses_every_text_instead_of_failing_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Saved past the admin's check (a shell, a fixture), or refused by a newer regex module than the one that saved it.
    with caplog.at_level(logging.ERROR, logger="agents.guardrails"):
        broken = guardrails("(unclosed\npassword")

    assert (await broken.check_input(["Hello there."])) is not None
    assert (await broken.check_input([""])) is None
    assert "'secrets' does not compile" in caplog.text


@pytest.mark.parametrize(
    ("patterns", "problem"),
    [("(unclosed", "missing )"), ("(" * 5000 + ")" * 5000, "nests too deeply")],
    ids=["unclosed", "nested too deeply"],
)
def test_a_regex_guardrail_that_does_not_compile_is_refused_by_the_admin(patterns: str, problem: str) -> None:
    guardrail = Guardrail(name="x", kind=MatchKind.REGEX, patterns=patterns)

    with pytest.raises(ValidationError, match=re.escape(problem)):
        guardrail.full_clean(exclude=["instance"])
