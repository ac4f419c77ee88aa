"""``Authorization: Bearer <key>`` for the API (DRF)."""

from __future__ import annotations

from typing import Any

from rest_framework.authentication import BaseAuthentication
from rest_framework.request import Request

from .exceptions import InvalidAPIKey
from .models import APIKey
from .services import authenticate_key, authenticate_key_async


def _raw_key(request: Request) -> str:
    header = request.META.get("HTTP_AUTHORIZATION", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise InvalidAPIKey("missing")
    return token.strip()


class APIKeyAuthentication(BaseAuthentication):
    """Authenticates with an API key; ``request.user`` is the key's organization, ``request.auth`` the key."""

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'

    def authenticate(self, request: Request) -> tuple[Any, APIKey]:
        key = authenticate_key(raw_key=_raw_key(request))
        return key.organization, key

    async def aauthenticate(self, request: Request) -> tuple[Any, APIKey]:
        key = await authenticate_key_async(raw_key=_raw_key(request))
        return key.organization, key
