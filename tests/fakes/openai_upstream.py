"""A fast OpenAI-compatible upstream on loopback, for gateway tests and the overhead benchmark.

Plain asyncio HTTP/1.1 with keep-alive, so it costs little next to what it serves. The model name
picks a behaviour: ``slow`` waits before answering, ``error-400`` / ``error-429`` / ``error-500-text`` fail, ``stall``
streams a little and then goes silent, ``trickle`` streams ``metadata.chunks`` chunks (120) ``metadata.interval``
seconds (0.5) apart: a long generation; ``bad-usage`` reports token counts that are not numbers; streams of
``crlf`` frame their events with CRLF, ``error-midstream`` sends an error event (naming a secret host) after two
chunks, ``no-done`` ends without ``[DONE]`` (a Response's stream without ``response.completed``); ``redirect``
answers 307 to another path, ``huge`` with a 300 KB answer. ``GET /last`` tells what the last request carried.

Run: ``python -m tests.fakes.openai_upstream --port 9000 [--api-key KEY] [--chunks 8]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

CHUNK_WORDS = ["The", " Willamette", " River", " flows", " north", " through", " Oregon", "."]


class Upstream:
    def __init__(self, *, api_key: str | None, chunks: int) -> None:
        self.api_key = api_key
        self.chunks = chunks
        self.last: dict[str, Any] = {}
        self.requests = 0
        self.abandoned_streams = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                keep_alive = await self.respond(method, path, headers, body, reader, writer)
                if not keep_alive:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def respond(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        self.requests += 1
        if method == "GET" and path == "/last":
            self.write_json(writer, 200, {**self.last, "abandoned_streams": self.abandoned_streams})
            return True
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            data = {}
        self.last = {
            "path": path,
            "authorization": headers.get("authorization"),
            "accept_encoding": headers.get("accept-encoding"),
            "body": data,
        }
        if self.api_key and headers.get("authorization") != f"Bearer {self.api_key}":
            self.write_json(
                writer,
                401,
                {
                    "error": {
                        "message": "bad upstream key",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "invalid_api_key",
                    }
                },
            )
            return True
        model = str(data.get("model", ""))
        if model == "slow":
            await asyncio.sleep(
                float(data.get("metadata", {}).get("delay", 30)) if isinstance(data.get("metadata"), dict) else 30
            )
        if model == "error-400":
            self.write_json(
                writer,
                400,
                {
                    "error": {
                        "message": "Upstream says no.",
                        "type": "invalid_request_error",
                        "param": "messages",
                        "code": "upstream_refused",
                    }
                },
            )
            return True
        if model == "error-429":  # as OpenAI's: its own type, and here no Retry-After
            self.write_json(
                writer,
                429,
                {"error": {"message": "Slow down.", "type": "tokens", "param": None, "code": "rate_limit_exceeded"}},
            )
            return True
        if model == "redirect":
            writer.write(b"HTTP/1.1 307 Temporary Redirect\r\nlocation: /elsewhere\r\ncontent-length: 0\r\n\r\n")
            return True
        if model == "error-500-text":
            self.write(writer, 500, b"text/plain", b"internal failure")
            return True
        if path.endswith("/chat/completions"):
            if data.get("stream"):
                await self.stream_chat(reader, writer, model, data, stall=model == "stall", trickle=model == "trickle")
            else:
                answer = self.chat(model)
                if model == "huge":
                    answer["choices"][0]["message"]["content"] = "x" * 300_000
                if model == "bad-usage":
                    answer["usage"] = {"prompt_tokens": "lots", "completion_tokens": -5, "total_tokens": None}
                self.write_json(writer, 200, answer)
            return True
        if path.endswith("/responses"):
            if data.get("stream"):
                await self.stream_response(writer, model)
            else:
                self.write_json(writer, 200, self.response(model))
            return True
        self.write_json(
            writer,
            404,
            {"error": {"message": "no such path", "type": "invalid_request_error", "param": None, "code": "not_found"}},
        )
        return True

    def chat(self, model: str) -> dict[str, Any]:
        return {
            "id": "chatcmpl-upstream",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(CHUNK_WORDS)},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 11, "completion_tokens": 8, "total_tokens": 19},
        }

    def response(self, model: str) -> dict[str, Any]:
        return {
            "id": "resp_upstream",
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "".join(CHUNK_WORDS), "annotations": []}],
                }
            ],
            "usage": {"input_tokens": 11, "output_tokens": 8, "total_tokens": 19},
        }

    async def stream_chat(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        model: str,
        data: dict[str, Any],
        *,
        stall: bool,
        trickle: bool,
    ) -> None:
        metadata = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
        chunks = int(metadata.get("chunks", 120)) if trickle else self.chunks
        interval = float(metadata.get("interval", 0.5)) if trickle else 0.0
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        base = {
            "id": "chatcmpl-upstream",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        events = [
            {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        ]
        for i in range(chunks):
            events.append(
                {
                    **base,
                    "choices": [
                        {"index": 0, "delta": {"content": CHUNK_WORDS[i % len(CHUNK_WORDS)]}, "finish_reason": None}
                    ],
                }
            )
        events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        if (data.get("stream_options") or {}).get("include_usage"):
            # As OpenAI sends it: "usage": null on every chunk, and the usage in a last chunk without choices.
            events = [{**event, "usage": None} for event in events]
            events.append(
                {
                    **base,
                    "choices": [],
                    "usage": {"prompt_tokens": 11, "completion_tokens": chunks, "total_tokens": 11 + chunks},
                }
            )
        separator = b"\r\n\r\n" if model == "crlf" else b"\n\n"
        for index, event in enumerate(events):
            if model == "error-midstream" and index == 2:
                failure = {"message": "overloaded at internal-7.example", "type": "server_error", "code": "overloaded"}
                self.chunk(writer, b"data: " + json.dumps({"error": failure}).encode() + separator)
                break
            self.chunk(writer, b"data: " + json.dumps(event).encode() + separator)
            if interval and 1 <= index <= chunks:
                await writer.drain()
                await asyncio.sleep(interval)
            if stall and index == 2:
                await writer.drain()
                await reader.read()  # until the client hangs up
                self.abandoned_streams += 1
                return
        if model not in ("no-done", "error-midstream"):
            self.chunk(writer, b"data: [DONE]" + separator)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def stream_response(self, writer: asyncio.StreamWriter, model: str) -> None:
        """A Response streamed as OpenAI streams one: its events, then ``response.completed`` with its usage."""
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        whole = self.response(model)
        item, part = whole["output"][0], whole["output"][0]["content"][0]
        started = {**whole, "status": "in_progress", "output": [], "usage": None}
        at = {"output_index": 0, "item_id": item["id"]}
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": started},
            {"type": "response.in_progress", "response": started},
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {**item, "status": "in_progress", "content": []},
            },
            {"type": "response.content_part.added", **at, "content_index": 0, "part": {**part, "text": ""}},
            *(
                {"type": "response.output_text.delta", **at, "content_index": 0, "delta": word, "logprobs": []}
                for word in CHUNK_WORDS
            ),
            {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"], "logprobs": []},
            {"type": "response.content_part.done", **at, "content_index": 0, "part": part},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
        ]
        if model != "no-done":
            events.append({"type": "response.completed", "response": whole})
        for number, event in enumerate(events):
            self.chunk(
                writer,
                f"event: {event['type']}\ndata: ".encode()
                + json.dumps({**event, "sequence_number": number}).encode()
                + b"\n\n",
            )
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    @staticmethod
    def chunk(writer: asyncio.StreamWriter, payload: bytes) -> None:
        writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")

    @staticmethod
    def write(writer: asyncio.StreamWriter, status: int, content_type: bytes, payload: bytes) -> None:
        reason = {
            200: b"OK",
            400: b"Bad Request",
            401: b"Unauthorized",
            404: b"Not Found",
            429: b"Too Many Requests",
            500: b"Internal Server Error",
        }[status]
        writer.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
            % (status, reason, content_type, len(payload))
            + payload
        )

    def write_json(self, writer: asyncio.StreamWriter, status: int, data: Any) -> None:
        self.write(writer, status, b"application/json", json.dumps(data).encode())


async def serve(port: int, *, api_key: str | None, chunks: int) -> None:
    upstream = Upstream(api_key=api_key, chunks=chunks)
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.port, api_key=args.api_key, chunks=args.chunks))


if __name__ == "__main__":
    main()
