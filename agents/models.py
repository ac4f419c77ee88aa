"""Agent instances (what an agent runs on, knows and refuses), and what the runtime keeps of its conversations."""

from __future__ import annotations

import unicodedata
from typing import Any, Literal

import regex
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone
from jinja2 import TemplateError

from agents.tools.registry import REGISTRY
from inference.engine.exceptions import ContextLengthExceeded
from inference.engine.execution import get_renderer
from inference.engine.prompting import render_prompt
from inference.engine.runners.base import RunnerError
from inference.models import HTTPSURLField

INSTANCE_ID = r"^[a-z0-9]+(?:[._-][a-z0-9]+)*$"


class FirstStep(models.TextChoices):
    MODEL = "model", "The model decides whether to use a tool"
    SEARCH = "search", "Search the knowledge with the user's message, then the model answers"
    TOOL = "tool", "The model must call one of the server tools first"


class AgentInstanceQuerySet(models.QuerySet["AgentInstance"]):
    def usable_by(self, organization_id: int) -> AgentInstanceQuerySet:
        return self.filter(enabled=True, model__enabled=True, organizations__id=organization_id)


class AgentInstance(models.Model):
    """An agent: a catalog model with instructions, server tools, knowledge and guardrails, offered to tenants."""

    instance_id = models.CharField(
        "id",
        max_length=200,
        unique=True,
        validators=[RegexValidator(INSTANCE_ID, "Lowercase letters and digits, separated by '.', '-' or '_'.")],
        help_text="What clients send as 'model', e.g. support.agent.spare-parts.",
    )
    name = models.CharField(max_length=200, blank=True)
    model = models.ForeignKey(
        "inference.CatalogEntry", on_delete=models.PROTECT, related_name="agent_instances", verbose_name="catalog model"
    )
    instructions = models.TextField(blank=True, help_text="The system prompt of every conversation.")
    tools = models.JSONField(default=list, blank=True, help_text="The server tools the runtime runs for this agent.")
    first_step = models.CharField(max_length=16, choices=FirstStep.choices, default=FirstStep.MODEL)
    reasons = models.BooleanField(
        "reasons", default=False, help_text="The model thinks before it answers (its catalog model must reason)."
    )
    temperature = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.0), MaxValueValidator(2.0)],
        help_text="For requests that set none (blank: 1.0). Small models answer best at 0.",
    )
    max_output_tokens = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Per response, for requests that set none (blank: the catalog model's maximum).",
    )
    organizations = models.ManyToManyField(
        "orgs.Organization", related_name="agent_instances", blank=True, help_text="The tenants that may use it."
    )
    enabled = models.BooleanField(default=True)
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)

    objects = AgentInstanceQuerySet.as_manager()

    class Meta:
        verbose_name = "agent instance"
        ordering = ["instance_id"]

    def __str__(self) -> str:
        return self.instance_id

    def clean(self) -> None:
        if not isinstance(self.tools, list) or not all(isinstance(name, str) for name in self.tools):
            raise ValidationError({"tools": "A list of tool names."})
        if unknown := sorted(set(self.tools) - set(REGISTRY)):
            raise ValidationError({"tools": f"Unknown tools: {', '.join(unknown)}."})
        if self.model_id is not None and not self.model.served_here:
            raise ValidationError({"model": f"The catalog model {self.model} is reached only through the gateway."})
        if self.tools and self.model_id is not None and not self.model.tools:
            raise ValidationError({"tools": f"The catalog model {self.model} cannot call tools."})
        if self.reasons and self.model_id is not None and not self.model.reasoning:
            raise ValidationError({"reasons": f"The catalog model {self.model} does not reason."})
        if self.first_step == FirstStep.SEARCH and "knowledge_search" not in self.tools:
            raise ValidationError({"first_step": "Searching first needs the knowledge_search tool."})
        if self.first_step == FirstStep.TOOL and not self.tools:
            raise ValidationError({"first_step": "Calling a tool first needs at least one server tool."})
        if self.instructions and self.model_id is not None and (problem := _instructions_problem(self)):
            raise ValidationError({"instructions": problem})


def _instructions_problem(instance: AgentInstance) -> str | None:
    """Why the instructions leave no room on the catalog model for a conversation, or None (also when the model's
    tokenizer cannot be loaded here: the catalog entry's own checks say why)."""
    entry = instance.model
    try:
        prompt = render_prompt(
            renderer=get_renderer(entry.runner, entry.runner_settings),
            messages=[{"role": "system", "content": instance.instructions}, {"role": "user", "content": ""}],
            tools=(),
            describe_tools=False,
            context_length=entry.context_length,
        )
        tokens, at_least = prompt.tokens, False
    except ContextLengthExceeded as exc:
        tokens, at_least = exc.prompt_tokens, exc.at_least
    except TemplateError as exc:
        return f"The catalog model {entry}'s chat template refuses them: {exc}"
    except RunnerError:
        return None
    if tokens < entry.context_length:
        return None
    return (
        f"These instructions take {'at least ' if at_least else ''}{tokens} tokens of the "
        f"catalog model {entry}'s context of {entry.context_length}: no conversation would fit beside them."
    )


class Document(models.Model):
    """A knowledge source of an instance: what its knowledge search finds and its answers cite."""

    instance = models.ForeignKey(AgentInstance, on_delete=models.CASCADE, related_name="documents")
    title = models.CharField(max_length=300)
    url = HTTPSURLField("URL", max_length=1000, help_text="Where the answer's citation points.")
    text = models.TextField()
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["instance", "title"]

    def __str__(self) -> str:
        return self.title


class Stage(models.TextChoices):
    INPUT = "input", "The user's input"
    OUTPUT = "output", "The answer"
    BOTH = "both", "Both"


class MatchKind(models.TextChoices):
    TERMS = "terms", "Words or phrases (whole words, any case)"
    REGEX = "regex", "Regular expressions (any case)"


# What compiling an admin's expression can raise: a syntax error, or nesting deeper than the parser recurses.
COMPILE_ERRORS = (regex.error, RecursionError, OverflowError)


# A counted repeat is compiled as that many copies of what it repeats: ``a{99999999}`` takes gigabytes and
# seconds to compile. Counts are bounded before compiling: each alone, and the copies all of them make, a count
# applied to a group multiplying what the group's own counts make.
MAX_REPEAT_COUNT = 1000
MAX_REPEATED_COPIES = 10_000
_COUNT = regex.compile(r"\{(\d*)(?:,(\d*))?\}")
_BRACED_ESCAPE = regex.compile(r"\\[pPNxgkou]\{[^}]*\}")


def _repeat_problem(expression: str) -> str | None:
    """Why ``expression``'s counted repeats would make too large a pattern, or None."""
    frames = [1]  # per open group: the most copies anything in it makes
    last = 0  # the copies the atom just read makes (0: no atom to repeat)
    made = 0  # the copies every count so far makes
    at = 0
    while at < len(expression):
        char = expression[at]
        if char == "\\":
            braced = _BRACED_ESCAPE.match(expression, at)
            at = braced.end() if braced else at + 2
            last = 1
            continue
        if char == "[":
            at = _class_end(expression, at)
            last = 1
            continue
        if char == "(":
            frames.append(1)
            last = 0
        elif char == ")" and len(frames) > 1:
            last = frames.pop()
        elif char == "{" and last and (count := _COUNT.match(expression, at)):
            least, most = count.group(1), count.group(2)
            bound = max(int(least or 0), int(most or 0)) if count.group(0).count(",") else int(least or 0)
            if bound > MAX_REPEAT_COUNT:
                return f"a repeat of {bound} is more than {MAX_REPEAT_COUNT}"
            last *= max(bound, 1)
            made += last
            if made > MAX_REPEATED_COPIES:
                return f"its repeats make {made} copies, more than {MAX_REPEATED_COPIES}"
            frames[-1] = max(frames[-1], last)
            at = count.end()
            continue
        else:
            last = 1
        frames[-1] = max(frames[-1], last)
        at += 1
    return None


def _class_end(expression: str, at: int) -> int:
    """Where the character class opening at ``at`` ends (past its ``]``)."""
    at += 1
    if expression[at : at + 1] == "^":
        at += 1
    if expression[at : at + 1] == "]":
        at += 1
    while at < len(expression) and expression[at] != "]":
        at += 2 if expression[at] == "\\" else 1
    return at + 1


def compile_line(expression: str) -> Any:
    """One expression as the guardrails match it: in any case. Raises ``regex.error`` for one whose counted
    repeats would take more memory and time to compile than a guardrail is worth."""
    if problem := _repeat_problem(expression):
        raise regex.error(problem)
    return regex.compile(expression, regex.IGNORECASE)


def _term(line: str) -> str:
    """A word or phrase as a pattern: literal, in the form the guardrails read text in (``guardrails.as_read``), its
    words apart by any whitespace, dashes or underscores, or by nothing (a phrase wrapped onto the next line, written
    ``credit-card`` or ``creditcard``, is the same phrase to a reader and to the model)."""
    words = [word for word in _WORD_BREAK.split(unicodedata.normalize("NFKC", line)) if word]
    return _BETWEEN_WORDS.join(regex.escape(word) for word in words)


_WORD_BREAK = regex.compile(r"[\s\p{Pd}_]+")
_BETWEEN_WORDS = r"[\s\p{Pd}_]*"


class Guardrail(models.Model):
    """A rule that blocks a turn: on a match the answer is replaced by the refusal message."""

    instance = models.ForeignKey(AgentInstance, on_delete=models.CASCADE, related_name="guardrails")
    name = models.CharField(max_length=100)
    applies_to = models.CharField(max_length=8, choices=Stage.choices, default=Stage.INPUT)
    kind = models.CharField(max_length=8, choices=MatchKind.choices, default=MatchKind.TERMS)
    patterns = models.TextField(help_text="One per line.")
    refusal = models.TextField(default="I can't help with that.", help_text="What the user is shown instead.")
    enabled = models.BooleanField(default=True)

    class Meta:
        ordering = ["instance", "name"]

    def __str__(self) -> str:
        return self.name

    def lines(self) -> list[str]:
        return [line.strip() for line in self.patterns.splitlines() if line.strip()]

    def compiled(self) -> tuple[Any, ...]:
        """The lines as ``regex`` patterns (the module whose matching can be given a time limit); raises one of
        ``COMPILE_ERRORS`` for a line that does not compile.

        Each expression is a pattern of its own, so that a line matches exactly what it matches alone: joined
        into one, a line's ``#`` comment under ``(?x)`` would swallow what follows it, and its group numbers
        would shift the back-references of the lines after it. Terms are literal, so they make one pattern.
        """
        if self.kind == MatchKind.REGEX:
            return tuple(compile_line(line) for line in self.lines())
        # Apart from the words around it: by anything but a letter or digit (an underscore, as in my_password, too).
        return (compile_line("|".join(rf"(?<![^\W_]){_term(line)}(?![^\W_])" for line in self.lines())),)

    def checks(self, stage: Literal["input", "output"]) -> bool:
        return self.enabled and self.applies_to in (stage, Stage.BOTH)

    def clean(self) -> None:
        if not self.lines():
            raise ValidationError({"patterns": "Give at least one word, phrase or expression."})
        if self.kind == MatchKind.REGEX:
            for line in self.lines():
                try:
                    compile_line(line)
                except COMPILE_ERRORS as exc:
                    problem = "it nests too deeply" if isinstance(exc, RecursionError) else str(exc)
                    raise ValidationError({"patterns": f"{line!r} is not a regular expression: {problem}."}) from None


class StoredResponse(models.Model):
    """One turn of a conversation kept with ``store: true``: its input items, its output items, its usage.

    ``previous`` links the turns; ``thread`` is the id of the conversation's first response, so that a
    conversation is pruned as a whole, counting from its last turn.
    """

    response_id = models.CharField(max_length=64, unique=True)
    organization = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="agent_responses")
    instance = models.ForeignKey(AgentInstance, on_delete=models.CASCADE, related_name="responses")
    api_key = models.ForeignKey("orgs.APIKey", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    previous = models.ForeignKey("self", on_delete=models.CASCADE, null=True, blank=True, related_name="continuations")
    thread = models.CharField(max_length=64, db_index=True)
    status = models.CharField(max_length=16)
    input_items = models.JSONField(default=list)
    output_items = models.JSONField(default=list)
    size = models.PositiveIntegerField(default=0, help_text="Bytes of its input and output items, as stored.")
    usage = models.JSONField(default=dict, blank=True)
    request_id = models.CharField(max_length=40, blank=True)
    created = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        verbose_name = "stored response"
        ordering = ["-created"]
        indexes = [models.Index(fields=["organization", "created"])]

    def __str__(self) -> str:
        return self.response_id


class Rating(models.TextChoices):
    POSITIVE = "positive", "Positive"
    NEGATIVE = "negative", "Negative"


class Feedback(models.Model):
    """A client's rating of an answer (one per response; rating again replaces it)."""

    response = models.OneToOneField(StoredResponse, on_delete=models.CASCADE, related_name="feedback")
    rating = models.CharField(max_length=8, choices=Rating.choices)
    comment = models.TextField(blank=True)
    meta = models.JSONField(default=dict, blank=True)
    api_key = models.ForeignKey("orgs.APIKey", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    created = models.DateTimeField(default=timezone.now)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "feedback"
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.rating} on {self.response}"
