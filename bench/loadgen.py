"""A small closed-loop HTTP/1.1 load generator on raw asyncio sockets.

N clients each keep one connection and send the next request as soon as the last one finished. It
measures latency to the end of the response and, for streams, to the first body bytes, and costs
little CPU itself, so the server under test is what is measured.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Results:
    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    elapsed: float = 0.0

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0

    def percentile(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        if len(values) == 1:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def build_request(host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, float | None]:
    """Read one response; return its status and when the first body bytes arrived."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = head.lower()
    first: float | None = None
    if b"transfer-encoding: chunked" in headers:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.strip().split(b";")[0], 16)
            if first is None and size:
                first = time.perf_counter()
            if size == 0:
                await reader.readuntil(b"\r\n")
                return status, first
            await reader.readexactly(size + 2)
    marker = b"content-length:"
    at = headers.find(marker)
    if at >= 0:
        length = int(headers[at + len(marker) : headers.find(b"\r\n", at)].strip())
        if length:
            await reader.readexactly(length)
        return status, time.perf_counter()
    # No length and not chunked: the body runs to the end of the connection.
    await reader.read()
    return status, time.perf_counter()


async def run(
    *,
    host: str,
    port: int,
    path: str,
    body: bytes,
    headers: dict[str, str],
    clients: int,
    duration: float,
    warmup: float,
) -> Results:
    request = build_request(host, port, path, body, headers)
    results = Results()
    start = time.perf_counter()
    measure_from = start + warmup
    stop_at = measure_from + duration

    async def client() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while time.perf_counter() < stop_at:
                sent = time.perf_counter()
                writer.write(request)
                try:
                    status, first = await _read_response(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    results.errors += 1
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port)
                    continue
                done = time.perf_counter()
                # Counted when it completes inside the window, so that slow servers still register.
                if measure_from <= done <= stop_at:
                    results.statuses[status] = results.statuses.get(status, 0) + 1
                    if status == 200:
                        results.latencies.append(done - sent)
                        if first is not None:
                            results.first_bytes.append(first - sent)
                    else:
                        results.errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    results.elapsed = duration
    return results
