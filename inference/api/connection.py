"""One HTTP/1.1 connection as ``manage.py serve`` holds it: Twisted's ``HTTPChannel`` with a deadline for
reading each request, a bound on its body as it arrives, and the API's error shape for the requests it refuses
before any application code runs.

Twisted's own timeout is an idle timeout, restarted by every byte received: a client that sends one header line
every few seconds never meets it, and enough such clients hold every file descriptor of the process. And what
Twisted cannot parse it answers with a bare ``400`` (or, for a line past its length limit, with nothing at all).
And Twisted reads a whole body before the application sees its request (Daphne then hands it over in one piece):
a body is bounded while it arrives, or a client declaring or sending gigabytes would have them all held first.
"""

from __future__ import annotations

import html
import re
import time
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import orjson
from daphne.http_protocol import HTTPFactory
from django.conf import settings
from twisted.internet import tcp
from twisted.internet.interfaces import ITCPTransport
from twisted.web.http import HTTPChannel

from inference.openai.errors import APIError, body_too_large, not_json

from .errors import is_browser_path
from .middleware import new_request_id


def request_timeout(seconds: float) -> APIError:
    return APIError(
        f"The request was not received in full within {seconds:g} s of its first byte.",
        code="request_timeout",
        status=HTTPStatus.REQUEST_TIMEOUT,
    )


def headers_too_large(channel: HTTPChannel) -> APIError:
    return APIError(
        f"The request's headers are too large: at most {channel.maxHeaders} headers, "
        f"{channel.MAX_LENGTH} bytes a line and {channel.totalHeadersSize} bytes in all.",
        code="headers_too_large",
        status=HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
    )


def uri_too_long(channel: HTTPChannel) -> APIError:
    return APIError(
        f"The request line is longer than {channel.MAX_LENGTH} bytes.",
        code="uri_too_long",
        status=HTTPStatus.REQUEST_URI_TOO_LONG,
    )


def malformed_head() -> APIError:
    return APIError(
        "The request is not valid HTTP/1.1: a malformed request line or header, a Content-Length that is not a "
        "number, or a body framed twice (two Content-Lengths, or Content-Length with Transfer-Encoding).",
        code="malformed_request",
    )


def malformed_chunked_body() -> APIError:
    return APIError("The request's chunked body is malformed.", code="malformed_request")


# A chunked body may come in a few chunks of any size, and in one more for every so many bytes it holds. Twisted reads
# chunks one by one in Python on the thread that serves every connection: a body of 1-byte chunks cost about a
# thousand times the CPU of the same bytes sent with a Content-Length, and held every other request back.
FREE_CHUNKS = 64
BYTES_PER_CHUNK = 256


def too_many_chunks() -> APIError:
    return APIError(
        f"The request's chunked body comes in too many small chunks: at most {FREE_CHUNKS}, and one more for every "
        f"{BYTES_PER_CHUNK} bytes of body. Send it in larger chunks, or with a Content-Length.",
        code="too_many_chunks",
    )


class APIChannel(HTTPChannel):
    """An HTTP/1.1 connection whose ``timeOut`` is a deadline for receiving each request, headers and body.

    A request's deadline starts with its first bytes and ends when its body is in: the response, however long it
    streams, is not held to it (Twisted stops the timeout while a request is handled), and a kept-alive connection's
    next request has a deadline of its own. A connection that sends nothing of a next request within ``timeOut`` is
    closed without a word (RFC 9112 9.5); one still sending its request at the deadline gets a 408."""

    # How long a connection being closed may take to go (the client reading what it was sent, or finishing what it
    # was sending, see ``_refuse``) before it is cut: Twisted's 15 s is long for a client that is trickling.
    abortTimeout = 5  # noqa: N815 (Twisted's name)
    _between_requests = True  # nothing of the next request has arrived yet
    _request_started = 0.0
    _refused = False

    def resetTimeout(self) -> None:  # noqa: N802 (Twisted's name)
        # Twisted calls this for every chunk received, which makes ``timeOut`` an idle timeout; here only the first
        # bytes of a request restart it.
        if self._between_requests:
            self._between_requests = False
            self._request_started = time.perf_counter()
            super().resetTimeout()

    def checkPersistence(self, request: Any, version: bytes) -> bool:  # noqa: N802 (Twisted's name)
        # Connection is a list (RFC 9110 7.6.1), commas between its options, in any number of fields: Twisted reads
        # the first field's words between spaces, and kept open a connection asked to close as "keep-alive, close".
        if fields := request.requestHeaders.getRawHeaders(b"Connection"):
            options = [option for field in fields for option in re.split(rb"[\s,]+", field) if option]
            request.requestHeaders.setRawHeaders(b"Connection", [b" ".join(options)])
        persistent: bool = super().checkPersistence(request, version)
        return persistent

    def requestDone(self, request: Any) -> None:  # noqa: N802 (Twisted's name)
        self._between_requests = True
        super().requestDone(request)

    # Twisted's TCP transport buffers every write until the reactor's next turn finds the socket writable: two
    # more system calls (registering the socket for writing, and unregistering it once the buffer is empty) and a
    # turn of the event loop for each piece of a streamed response. A write that finds nothing buffered is sent
    # at once; what the socket does not take, and every write behind it, is buffered as before.

    def write(self, data: bytes) -> None:
        if (rest := self._send_now(data)) is not None:
            super().write(rest)

    def writeSequence(self, iovec: list[bytes]) -> None:  # noqa: N802 (Twisted's name)
        self.write(b"".join(iovec))

    def _send_now(self, data: bytes) -> bytes | None:
        """Sends what the socket takes of ``data`` when the transport holds nothing unsent; the rest (None when
        none is left)."""
        transport = self.transport
        if (
            type(transport) is not tcp.Server
            or not data
            or not transport.connected
            or transport.disconnecting
            or transport.dataBuffer
            or transport._tempDataLen
        ):
            return data
        sent = transport.writeSomeData(data)
        if not isinstance(sent, int):  # the connection is lost: the reactor's own write reports it
            return data
        return data[sent:] or None

    def timeoutConnection(self) -> None:  # noqa: N802 (Twisted's name)
        if self._between_requests:
            super().timeoutConnection()
        else:
            self._refuse(request_timeout(self.timeOut or 0))

    def headerReceived(self, line: bytes) -> bool:  # noqa: N802 (Twisted's name)
        try:
            return bool(super().headerReceived(line))
        except ValueError:  # a Content-Length of more digits than Python reads as a number: past any bound
            self._refuse(body_too_large())
            return False

    def allHeadersReceived(self) -> None:  # noqa: N802 (Twisted's name)
        # The body's bound, before any of it is read (and before a ``100 Continue`` invites it): a declared length
        # at once, a chunked body as its chunks arrive. ``length`` is None for a chunked body.
        limit = settings.MAX_REQUEST_BODY_BYTES
        if self.length is not None and self.length > limit:
            self._refuse(body_too_large())
            return
        if self.length is None and self._transferDecoder is not None:
            _bound_chunks(self._transferDecoder, limit, self)
        super().allHeadersReceived()

    def allContentReceived(self) -> None:  # noqa: N802 (Twisted's name)
        # A chunked body's end can come in the same read as the chunk that took it past its bound.
        if not self._refused:
            super().allContentReceived()

    def lineLengthExceeded(self, line: bytes) -> None:  # noqa: N802 (Twisted's name)
        # Until a request's first line is in, it has no ``Request`` (and only it would be in ``requests`` now: the
        # previous one is done, or Twisted would not be parsing lines).
        self._refuse(headers_too_large(self) if self.requests else uri_too_long(self))

    def _respondToBadRequestAndDisconnect(self) -> None:  # noqa: N802 (Twisted's name)
        # Twisted's one way out (private in name, not in role) for whatever it cannot parse: the request line, a
        # header, the body's framing, a chunk.
        if self._receivedHeaderSize > self.totalHeadersSize or self._receivedHeaderCount > self.maxHeaders:
            self._refuse(headers_too_large(self))
        elif self.line_mode:
            self._refuse(malformed_head())
        elif self._multipart():
            # Twisted parses a multipart/form-data body itself, and one that does not parse ends here; the API takes
            # JSON only, as it says of a multipart body that parses.
            self._refuse(not_json())
        else:
            self._refuse(malformed_chunked_body())

    def _multipart(self) -> bool:
        request = self.requests[-1] if self.requests else None
        content_type = request.requestHeaders.getRawHeaders(b"content-type", [b""])[0] if request else b""
        return bool(content_type.split(b";", 1)[0].strip().lower().startswith(b"multipart/"))

    def _refuse(self, error: APIError) -> None:
        """Answer ``error`` and close, reading no more of the request.

        The connection is closed for writing only, and what the client still sends is read and dropped until it
        closes its side (at most ``abortTimeout`` seconds): closing outright with its bytes unread would reset the
        connection, and a client still sending (a 1 MB header) would see the reset instead of the answer."""
        if self._refused:
            return
        self._refused = True
        self.setTimeout(None)
        self.dataReceived = self.lineReceived = self.rawDataReceived = _drop  # type: ignore[method-assign]
        phrase = HTTPStatus(error.status).phrase
        if is_browser_path(urlsplit(getattr(self, "_path", b"")).path.decode("latin-1")):
            # A person at the admin (an upload past the bound) reads a page, as Django's own errors are there.
            content_type, body = "text/html; charset=utf-8", _page(error, phrase)
        else:
            content_type, body = "application/json", orjson.dumps(error.body())
        took = (time.perf_counter() - self._request_started) * 1000
        head = (
            f"HTTP/1.1 {error.status} {phrase}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
            f"X-Request-Id: {new_request_id()}\r\nServer-Timing: total;dur={took:.3f}\r\n\r\n"
        )
        transport: Any = self.transport  # a zope interface, whose methods mypy cannot call
        transport.write(head.encode() + body)
        self._networkProducer.unregisterProducer()
        if ITCPTransport.providedBy(transport):
            transport.loseWriteConnection()
            self._abortingCall = self.callLater(self.abortTimeout, self.forceAbortClient)
        else:
            transport.loseConnection()


def _page(error: APIError, phrase: str) -> bytes:
    title = f"{error.status} {phrase}"
    return f"<!doctype html><title>{title}</title><h1>{title}</h1><p>{html.escape(error.message)}</p>".encode()


def _drop(data: bytes) -> None:
    pass


def _bound_chunks(decoder: Any, limit: int, channel: APIChannel) -> None:
    """Bounds a chunked body (Twisted's ``_ChunkedTransferDecoder``) to ``limit`` bytes, and its chunks to what the
    bytes pay for: a chunk past either bound is refused once its size line is in, and the rest dropped."""
    received = chunks = 0
    deliver, read_size = decoder.dataCallback, decoder._dataReceived_CHUNK_LENGTH

    def piece(data: bytes) -> None:
        nonlocal received
        received += len(data)
        if not channel._refused:
            deliver(data)

    def size_line() -> bool:
        nonlocal chunks
        more = bool(read_size())
        if more:
            chunks += 1
            body = received + decoder.length
            if body > limit:
                channel._refuse(body_too_large())
            elif chunks > FREE_CHUNKS + body // BYTES_PER_CHUNK:
                channel._refuse(too_many_chunks())
        return more

    decoder.dataCallback = piece
    decoder._dataReceived_CHUNK_LENGTH = size_line


class APIHTTPFactory(HTTPFactory):
    """Daphne's HTTP factory, its connections ``APIChannel``s with ``HTTP_REQUEST_READ_TIMEOUT_SECONDS`` to send
    each request in. Twisted's factory wraps each connection in a proxy that can switch it to HTTP/2 once TLS has
    negotiated it; ``serve`` listens on plain TCP, where that never happens."""

    protocol = APIChannel

    def __init__(self, server: Any) -> None:
        super().__init__(server)
        self.timeOut = settings.HTTP_REQUEST_READ_TIMEOUT_SECONDS
