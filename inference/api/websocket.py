"""WebSocket upgrades: the API is HTTP only, so every upgrade is answered at once with 405 (Allow: POST)."""

from __future__ import annotations

from typing import Any

import orjson

from inference.openai.errors import method_not_allowed


async def refuse_websocket(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await receive()  # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        error = method_not_allowed("WebSocket is not served; send the request over HTTPS with POST.")
        await send(
            {
                "type": "websocket.http.response.start",
                "status": error.status,
                "headers": [(b"allow", b"POST"), (b"content-type", b"application/json")],
            }
        )
        await send({"type": "websocket.http.response.body", "body": orjson.dumps(error.body())})
        return
    await send({"type": "websocket.close", "code": 1008})
