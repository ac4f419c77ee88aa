"""What an upstream's base URL may be: the root of an OpenAI-compatible API, to which the gateway appends the
endpoint's path (``chat/completions``). Read by the settings and the catalog alike."""

from __future__ import annotations

import functools
from urllib.parse import urlsplit


@functools.lru_cache(maxsize=256)  # asked on every gateway request, of a few URLs
def upstream_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be an upstream's base URL, or None."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port out of range, a bracket never closed
        return f"it cannot be read as a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "it is not an http(s) URL with a host"
    if parts.username is not None or parts.password is not None:
        return "it holds credentials: give the upstream's key as its API key, not in the URL"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "it has a query or a fragment: the endpoint's path is appended to the URL, so give its root alone"
    if port == 0:
        return "its port is 0"
    return None
