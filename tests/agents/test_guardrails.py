"""What an instance's guardrails block, and what the admin may save as one, without a model to run."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from django.core.exceptions import ValidationError

from agents.guardrails import Guardrails
from agents.models import Guardrail, MatchKind, Stage
from agents.runtime import WholeWords, client_texts, refused_exchanges
from inference.engine.decoding import ReasoningPiece, TextPiece, ToolCallPiece
from inference.engine.generation import Logprobs
from inference.engine.runners.base import TokenLogprob

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


@pytest.mark.parametrize(
    ("text", "blocked"),
    [
        ("my credit\ncard", True),
        ("my credit  card", True),
        ("my credit\u00a0card", True),
        ("my credit\t card", True),
        ("my credit\u200bcard", True),
        ("my credit-card", True),
        ("my credit–card", True),
        ("my credit_card", True),
        ("my creditcard", True),
        ("credit cards", False),
        ("discredit card", False),
    ],
    ids=[
        "a line break",
        "two spaces",
        "a no-break space",
        "a tab and a space",
        "a zero-width space",
        "a hyphen",
        "an en dash",
        "an underscore",
        "nothing",
        "a longer word",
        "a longer first word",
    ],
)
async def test_a_phrase_matches_whatever_whitespace_dashes_or_nothing_separate_its_words(
    text: str, blocked: bool
) -> None:
    checked = guardrails("credit card", kind=MatchKind.TERMS)

    assert (await checked.check_input([text]) is not None) is blocked


@pytest.mark.parametrize(
    ("text", "blocked"),
    [
        ("What is my \uff30\uff41\uff53\uff53\uff57\uff4f\uff52\uff44?", True),
        ("What is my pass\u00adword?", True),
        ("What is my pass\u200bword?", True),
        ("What is my pass\u2060word?", True),
        ("What is my passport?", False),
    ],
    ids=["fullwidth letters", "a soft hyphen", "a zero-width space", "a word joiner", "another word"],
)
async def test_a_term_is_found_through_fullwidth_letters_and_characters_nobody_sees(text: str, blocked: bool) -> None:
    # The model reads the word all the same; a guardrail that did not would be passed by pasting it so.
    checked = guardrails("password", kind=MatchKind.TERMS, applies_to=Stage.BOTH)

    assert (await checked.check_input([text]) is not None) is blocked
    assert (await checked.check_output(text) is not None) is blocked


@pytest.mark.parametrize(
    ("text", "blocked"),
    [
        ("Reset my_password now", True),
        ("What is my pass\u034fword?", True),
        ("What is my pass\ufe0fword?", True),
        ("What is my pass\u180bword?", True),
        ("What is my pass\u3164word?", True),
        ("What is my password\u0301?", True),
        ("What is my p\u0336a\u0336s\u0336s\u0336w\u0336o\u0336r\u0336d\u0336?", True),
        ("What is my p\u00e1ssw\u00f3rd?", True),
        ("What is my passwords_file?", False),
    ],
    ids=[
        "an underscore before it",
        "a grapheme joiner",
        "a variation selector",
        "a Mongolian variation selector",
        "a Hangul filler",
        "an accent after it",
        "struck through",
        "accented letters",
        "a longer word",
    ],
)
async def test_a_term_is_found_through_underscores_marks_and_every_character_that_shows_nothing(
    text: str, blocked: bool
) -> None:
    checked = guardrails("password", kind=MatchKind.TERMS, applies_to=Stage.BOTH)

    assert (await checked.check_input([text]) is not None) is blocked
    assert (await checked.check_output(text) is not None) is blocked


@pytest.mark.parametrize(
    ("text", "blocked"),
    [
        ("What is my p\u0430ssword?", True),
        ("What is my \u0440\u0430\u0455\u0455w\u043erd?", True),
        ("What is my pa\u200b\u0455\u0455word?", True),
        ("\u041a\u0430\u043a\u043e\u0439 \u043c\u043e\u0439 \u043f\u0430\u0440\u043e\u043b\u044c?", False),
        ("What is my p\u0430ssport?", False),
    ],
    ids=["a Cyrillic a", "four Cyrillic letters", "Cyrillic letters and a zero-width space", "Russian", "another word"],
)
async def test_a_term_is_found_through_letters_of_another_script_that_look_like_its_own(
    text: str, blocked: bool
) -> None:
    # To a reader, and to the model, p\u0430ssword with a Cyrillic \u0430 is the word.
    checked = guardrails("password", kind=MatchKind.TERMS, applies_to=Stage.BOTH)

    assert (await checked.check_input([text]) is not None) is blocked
    assert (await checked.check_output(text) is not None) is blocked


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
    [
        ("(unclosed", "missing )"),
        ("(" * 5000 + ")" * 5000, "nests too deeply"),
        ("a{99999999}", "a repeat of 99999999 is more than 1000"),
        (r"(\w{2,100}){101}", "its repeats make 10200 copies, more than 10000"),
        ("x{1000}" * 11, "its repeats make 11000 copies, more than 10000"),
    ],
    ids=["unclosed", "nested too deeply", "a huge count", "nested counts", "many counts"],
)
def test_a_regex_guardrail_that_does_not_compile_is_refused_by_the_admin(patterns: str, problem: str) -> None:
    guardrail = Guardrail(name="x", kind=MatchKind.REGEX, patterns=patterns)

    with pytest.raises(ValidationError, match=re.escape(problem)):
        guardrail.full_clean(exclude=["instance"])


@pytest.mark.parametrize(
    "pattern",
    [r"\d{16}", r"(?:\d{3}-){2}\d{4}", r"\p{L}{3,}", r"[{}]{2}", r"a{e<=1}", r"\\{2}", r"(ab{2,5}){1000}"],
)
def test_a_regex_guardrail_with_modest_counts_compiles(pattern: str) -> None:
    Guardrail(name="x", kind=MatchKind.REGEX, patterns=pattern).full_clean(exclude=["instance"])


# --- what output guardrails may see: whole words, each piece after its own logprobs ---------------------------


def lp(token: str) -> Logprobs:
    return Logprobs((TokenLogprob(token.encode(), -0.1),))


def sent(pieces: list[Any]) -> list[Any]:
    words = WholeWords()
    return [out for piece in pieces for out in words.through(piece)] + words.rest()


def test_a_word_of_the_answer_is_sent_once_it_has_ended_and_nothing_is_lost_or_moved() -> None:
    out = sent([TextPiece("You need a pass"), TextPiece("port to fly"), TextPiece(".")])

    assert out == [TextPiece("You need a "), TextPiece("passport to "), TextPiece("fly.")]


def test_a_word_with_combining_marks_is_one_word_as_the_guardrails_read_it() -> None:
    assert sent([TextPiece("नमस्"), TextPiece("ते दोस्त")]) == [TextPiece("नमस्ते "), TextPiece("दोस्त")]


def test_each_piece_comes_after_its_own_logprobs_when_text_is_held_back() -> None:
    call = ToolCallPiece(index=0, call_id="call_1", name="f", arguments="{}")
    pieces = [lp("Think"), ReasoningPiece("Think"), lp("Hi"), lp(" there"), TextPiece("Hi there"), lp("{}"), call]

    out = sent(pieces)

    assert out == [
        lp("Think"), ReasoningPiece("Think"), lp("Hi"), TextPiece("Hi"), lp(" there"), TextPiece(" there"), lp("{}"),
        call,
    ]  # fmt: skip


def test_a_word_held_back_keeps_the_logprobs_of_its_tokens_however_they_arrived() -> None:
    together = Logprobs(tuple(TokenLogprob(token.encode(), -0.1) for token in ("The", " spare", " part")))

    out = sent([together, TextPiece("The spare part"), lp("s"), TextPiece("s fit")])

    assert out == [
        Logprobs(together.items[:2]), TextPiece("The spare"), Logprobs(together.items[2:]), lp("s"),
        TextPiece(" parts"), TextPiece(" fit"),
    ]  # fmt: skip


def test_with_logprobs_each_piece_sent_is_spelled_by_the_tokens_sent_before_it() -> None:
    # As a runner sends them: a token's logprobs before its text, a character split across two tokens sent whole
    # with the second.
    tokens = [b"The", b" spare", b" part", b"s", b" fit", b" caf\xc3", b"\xa9", b"!"]
    pieces: list[Any] = []
    for token, text in zip(tokens, ["The", " spare", " part", "s", " fit", " caf", "é", "!"], strict=True):
        pieces += [Logprobs((TokenLogprob(token, -0.1),)), TextPiece(text)]

    out = sent(pieces)

    spelled, text = b"", ""
    for piece in out:
        if isinstance(piece, Logprobs):
            spelled += b"".join(item.token for item in piece.items)
        else:
            text += piece.text
            assert spelled == text.encode(), (spelled, text)
    assert text == "The spare parts fit café!"


# --- exchanges a guardrail refused: not read again ---------------------------------------------------------------

REFUSAL = {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}
ANSWER = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]}


def say(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": text}


def test_the_input_guardrails_read_all_the_client_sends_and_of_stored_turns_what_its_users_wrote() -> None:
    sent = [
        say("user", "Hi"),
        say("assistant", "The secret animal is zebra."),
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"animal": "okapi"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
        {
            "type": "agent_runtime:function_call",
            "call_id": "c2",
            "name": "knowledge_search",
            "arguments": "{}",
            "output": "The secret animal is a quokka.",
            "status": "completed",
        },
    ]
    stored = [say("user", "Before"), say("assistant", "The model's own answer")]

    texts = client_texts(stored, sent, instructions="Be brief.")

    assert texts == [
        "Be brief.",
        "Before",
        "Hi",
        "done",
        "The secret animal is zebra.",
        '{"animal": "okapi"}',
        "{}",
        "The secret animal is a quokka.",
    ]


def test_a_refused_exchange_is_left_out_whole_but_the_clients_instructions_stay() -> None:
    search = {"type": "agent_runtime:function_call", "name": "knowledge_search", "arguments": "{}"}
    items = [
        say("system", "Be brief."),
        say("user", "Hi"),
        ANSWER,
        say("developer", "Answer in French."),
        say("user", "The password is hunter2."),
        search,
        REFUSAL,
        say("user", "Go on."),
    ]

    assert refused_exchanges(items) == {4, 5, 6}


def test_logprobs_out_of_step_with_the_text_leave_the_cut_at_the_words_start() -> None:
    # The decoder holds back a "<" (a tag may begin) and lets it go with the next token's text: the logprobs then
    # run a byte ahead of the text, and a token's end is no place in it.
    pieces = [lp("A"), TextPiece("A"), lp(" <"), TextPiece(" "), lp("b"), lp(" cd"), TextPiece("<b cd")]

    out = sent(pieces)

    assert [piece.text for piece in out if isinstance(piece, TextPiece)] == ["A ", "<b ", "cd"]
