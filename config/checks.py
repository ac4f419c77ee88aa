"""System checks for the environment-driven settings."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register


@register(Tags.compatibility, deploy=False)
def check_environment(app_configs: Any = None, **kwargs: Any) -> list[Error | Warning]:
    messages: list[Error | Warning] = [
        Error(message, hint=hint, id=check_id) for check_id, message, hint in settings.CONFIG_PROBLEMS
    ]
    engine = settings.DATABASES["default"]["ENGINE"]
    if settings.DISTRIBUTED and engine.endswith("sqlite3"):
        messages.append(
            Warning(
                "REDIS_URL is set (distributed mode) but the database is SQLite.",
                hint="Workers on other hosts cannot reach a local SQLite file: set DATABASE_URL to PostgreSQL.",
                id="config.W001",
            )
        )
    if not settings.DEBUG and not settings.SECRET_KEY_FROM_ENV and settings.DISTRIBUTED:
        messages.append(
            Warning(
                "SECRET_KEY is generated locally while running distributed.",
                hint=(
                    "Every API process must share one SECRET_KEY (and API_KEY_HASH_SECRET): set it in the environment."
                ),
                id="config.W002",
            )
        )
    if settings.GATEWAY_API_KEY and not settings.GATEWAY_BASE_URL:
        messages.append(
            Error(
                "GATEWAY_API_KEY is set without GATEWAY_BASE_URL.",
                hint="Set GATEWAY_BASE_URL to the upstream's OpenAI-compatible base URL, e.g. https://host/v1.",
                id="config.E010",
            )
        )
    if settings.MAX_REQUEST_BODY_BYTES < 1024:
        messages.append(
            Error(
                "MAX_REQUEST_BODY_BYTES is below 1024 bytes.",
                hint="Requests could not carry a prompt.",
                id="config.E011",
            )
        )
    return messages
