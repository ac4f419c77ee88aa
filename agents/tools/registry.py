"""The registry of server tools, and how one is run; it imports no model, so the models can check names here.

A tool is registered by name (the built-in ones when the app is ready, see ``agents.apps``); an instance
lists the names it may use. A tool's ``run`` is synchronous (database work) and runs on the shared pool.
It raises ``ToolError`` to fail with a message the model and the client see; any other exception is
logged and reported without its details.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.db import db_task
from inference.engine.decoding import FunctionTool

logger = logging.getLogger("agents.tools")


class ToolError(Exception):
    """A tool could not do its job; the message says why, for the model and the client."""


@dataclass(frozen=True, slots=True)
class Source:
    title: str
    url: str


@dataclass(frozen=True, slots=True)
class ToolResult:
    output: str
    sources: tuple[Source, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolContext:
    instance_pk: int
    organization_id: int


@dataclass(frozen=True, slots=True)
class ServerTool:
    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[[ToolContext, dict[str, Any]], ToolResult]

    def function_tool(self) -> FunctionTool:
        return FunctionTool(self.name, self.description, self.parameters, None)


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """A finished run: its output, or its error; the sources it found."""

    output: str | None
    error: str | None
    sources: tuple[Source, ...]


REGISTRY: dict[str, ServerTool] = {}


def register(tool: ServerTool) -> ServerTool:
    REGISTRY[tool.name] = tool
    return tool


def _checked(tool: ServerTool, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, dict):
        raise ToolError(f"{tool.name} takes a JSON object of arguments.")
    missing = [name for name in tool.parameters.get("required", ()) if name not in arguments]
    if missing:
        raise ToolError(f"{tool.name} needs the argument(s) {', '.join(missing)}.")
    return arguments


def _run(tool: ServerTool, context: ToolContext, arguments: Any) -> ToolResult:
    return tool.run(context, _checked(tool, arguments))


_run_on_pool = db_task(_run)


async def run_tool(tool: ServerTool, *, context: ToolContext, arguments: Any) -> ToolOutcome:
    error: str | None
    try:
        result = await _run_on_pool(tool, context, arguments)
    except ToolError as exc:
        error, result = str(exc), None
    except Exception:
        logger.exception("server tool %s failed", tool.name)
        error, result = f"{tool.name} failed unexpectedly.", None
    else:
        error = None
    if result is None:
        return ToolOutcome(output=None, error=error, sources=())
    return ToolOutcome(output=result.output, error=None, sources=result.sources)
