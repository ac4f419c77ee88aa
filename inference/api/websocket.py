"""WebSocket upgrades: the API is HTTP only, so every upgrade is answered at once with 405 (Allow: POST)."""

from __future__ import annotations

import json
from typing import Any

from asgiref.typing import ASGIReceiveCallable, ASGISendCallable


async def refuse_websocket(scope: dict[str, Any], receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    await receive()  # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        body = json.dumps(
            {
                "error": {
                    "message": "WebSocket is not served; send the request over HTTPS with POST.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "method_not_allowed",
                }
            }
        ).encode()
        await send(
            {
                "type": "websocket.http.response.start",
                "status": 405,
                "headers": [(b"allow", b"POST"), (b"content-type", b"application/json")],
            }
        )
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.close", "code": 1008})
