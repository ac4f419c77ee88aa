"""``Authorization: Bearer <key>`` for the API (DRF)."""

from __future__ import annotations

from typing import Any

from rest_framework.authentication import BaseAuthentication
from rest_framework.request import Request

from .db import db_task
from .exceptions import InvalidAPIKey
from .models import APIKey
from .services import authenticate_key


def _raw_key(request: Request) -> str:
    header = request.META.get("HTTP_AUTHORIZATION", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise InvalidAPIKey("missing")
    return token.strip()


_authenticate_key = db_task(authenticate_key)


class APIKeyAuthentication(BaseAuthentication):
    """Authenticates with an API key; ``request.user`` is the key's organization, ``request.auth`` the key."""

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'

    def authenticate(self, request: Request) -> tuple[Any, APIKey]:
        key = authenticate_key(raw_key=_raw_key(request))
        return key.organization, key

    async def aauthenticate(self, request: Request) -> tuple[Any, APIKey]:
        key = await _authenticate_key(raw_key=_raw_key(request))
        return key.organization, key
