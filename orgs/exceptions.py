"""Domain errors of orgs; the API layer maps them to OpenAI-shaped responses."""

from __future__ import annotations


class InvalidAPIKey(Exception):
    """The presented key is missing, malformed, unknown, revoked, expired, or its organization is inactive."""


class LimitExceeded(Exception):
    """Admission refused: ``limit`` names which one, ``retry_after`` is whole seconds until the request fits, or
    ``None`` when it never will (a limit of 0, or more tokens than the tokens per minute): waiting does not help."""

    def __init__(
        self, *, limit: str, retry_after: int | None, detail: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.limit = limit
        self.retry_after = retry_after
        self.detail = detail
        self.headers = headers or {}
