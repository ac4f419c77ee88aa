"""What a catalog model can do, checked once for every API: tools, structured output, reasoning, image input.

Chat completions, Responses and the agent runtime describe what a request needs in the same terms and
get the same answer; the reasoning-effort rule (``none`` and ``minimal`` ask for no reasoning) is here
alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from .exceptions import Capability, CapabilityMissing

# Efforts that ask the model not to reason; any other effort asks it to.
NO_REASONING = frozenset({"none", "minimal"})


def asks_for_reasoning(effort: str | None) -> bool:
    """Whether a request's reasoning effort asks for reasoning (unset does not ask)."""
    return effort is not None and effort not in NO_REASONING


def reasoning_on(*, model_reasons: bool, effort: str | None) -> bool:
    """Whether a model reasons for a request: reasoning models do unless the effort turns it off."""
    return model_reasons and effort not in NO_REASONING


def check(
    *,
    model_id: str,
    offers: Mapping[str, bool],
    tools: bool = False,
    reasoning_effort: str | None = None,
    structured_output: bool = False,
    images: bool = False,
) -> None:
    """Raises ``CapabilityMissing`` for the first thing the request needs that ``offers`` (a catalog entry's
    ``capabilities()``, or an agent's) lacks."""
    needs: dict[Capability, bool] = {
        "tools": tools,
        "reasoning": asks_for_reasoning(reasoning_effort),
        "json_schema": structured_output,
        "image_input": images,
    }
    for capability, needed in needs.items():
        if needed and not offers.get(capability, False):
            raise CapabilityMissing(model_id, capability)
