from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import resource
import socket
import time
from http import HTTPStatus
from typing import Any

import orjson
from daphne import http_protocol
from daphne import server as daphne_server
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from twisted.internet import defer, reactor
from twisted.logger import globalLogPublisher
from twisted.web import http as twisted_http

from inference.api.connection import APIHTTPFactory
from inference.api.middleware import REQUEST_ID_EXTENSION, new_request_id
from inference.engine import dispatch, execution, generation
from inference.engine.preflight import check_runner
from inference.models import CatalogEntry
from inference.openai.errors import response_timeout
from inference.serving import gateway
from inference.serving.metered import RESPONSE_TIMED_OUT
from inference.usage.reports import start_periodic_rollup

logger = logging.getLogger("inference.serving")

# How long the streams ended at the end of the grace period have to send their last events.
ENDING_SECONDS = 5


class _HTTPOnlyRequest(http_protocol.WebRequest):
    """The API serves HTTP only: a WebSocket upgrade is handled as the plain HTTP request it came with,
    so the endpoint answers it at once (405 with ``Allow: POST`` on the POST-only endpoints).

    A request whose response has not begun within ``HTTP_TIMEOUT_SECONDS`` gets a 504 in the API's error shape,
    and the application is told the client is gone, and why (so a generation behind it is cancelled, and its usage
    recorded as the 504 it was). A response under way, a stream, is never cut here: streams end at their own limits
    (``STREAM_MAX_SECONDS``, ``GATEWAY_STREAM_MAX_SECONDS``), cleanly, where daphne would cut them mid-event."""

    def process(self) -> Any:
        self.requestHeaders.removeHeader(b"Upgrade")
        return super().process()

    def check_timeouts(self) -> None:
        timeout = self.server.http_timeout
        if not timeout or self._response_started or self.finished or self.duration() <= timeout:
            return
        body = orjson.dumps(response_timeout(timeout).body())
        headers = [(b"Content-Type", b"application/json"), (b"Content-Length", str(len(body)).encode())]
        if request_id := getattr(self, "request_id", None):
            headers.append((b"x-request-id", request_id.encode()))
        headers.append((b"Server-Timing", f"total;dur={self.duration() * 1000:.3f}".encode()))  # as every answer
        if self.path:  # as ``send_disconnect``, saying why, before finishing the response sends the plain one
            self.application_queue.put_nowait({"type": "http.disconnect", "reason": RESPONSE_TIMED_OUT})
        self.handle_reply({"type": "http.response.start", "status": 504, "headers": headers})
        self.handle_reply({"type": "http.response.body", "body": body})


class _DrainingServer(daphne_server.Server):
    """Daphne's server, stopping gracefully: told to stop (SIGTERM, SIGINT), it listens no more at once, lets the
    requests under way finish for up to ``SHUTDOWN_GRACE_SECONDS``, then ends the generations still running, each
    stream with a ``server_shutting_down`` error and its usage recorded, as any failed one. Only what is left after
    that (a gateway stream) is cut, as Daphne cuts every request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ports: list[Any] = []

    def create_application(self, protocol: Any, scope: dict[str, Any]) -> Any:
        """Numbers each HTTP request here, so that a 504 the server gives itself (``check_timeouts``) carries the id
        the application logs and records it under (``REQUEST_ID_EXTENSION``)."""
        if scope.get("type") == "http":
            protocol.request_id = new_request_id()
            scope.setdefault("extensions", {})[REQUEST_ID_EXTENSION] = {"id": protocol.request_id}
        return super().create_application(protocol, scope)

    def listen_success(self, port: Any) -> None:
        self._ports.append(port)
        super().listen_success(port)

    def _under_way(self) -> int:
        instances = (details.get("application_instance") for details in self.connections.values())
        return sum(1 for instance in instances if instance is not None and not instance.done())

    def kill_all_applications(self) -> defer.Deferred[Any]:
        for port in self._ports:
            port.stopListening()
        drained: defer.Deferred[Any] = defer.Deferred()
        grace = settings.SHUTDOWN_GRACE_SECONDS
        started, interrupted = time.monotonic(), False
        clock: Any = reactor  # Twisted's interfaces read as methods without self to mypy
        if under_way := self._under_way():
            logger.warning(
                "shutting down: %s under way %s up to %d s to finish",
                "1 request" if under_way == 1 else f"{under_way} requests",
                "has" if under_way == 1 else "have",
                grace,
            )

        def check() -> None:
            nonlocal interrupted
            waited = time.monotonic() - started
            if not self._under_way() or waited >= grace + ENDING_SECONDS:
                drained.callback(None)
                return
            if waited >= grace and not interrupted:
                interrupted = True
                generation.refuse_new()
                logger.warning("shutting down: %d generations ended unfinished", generation.interrupt_all())
            clock.callLater(0.05, check)

        check()
        # The requests are done: the gateway's connections to upstreams are closed before the loop ends.
        drained.addCallback(lambda _: defer.Deferred.fromFuture(asyncio.ensure_future(gateway.close_session())))
        drained.addCallback(lambda _: super(_DrainingServer, self).kill_all_applications())
        return drained


def media_type(header: bytes) -> bytes:
    """What Twisted's ``_parseContentType`` returns (the lower-cased media type, ``text/plain`` when malformed),
    without building an e-mail message for every request: that was a twentieth of the API's CPU time."""
    media = header.split(b";", 1)[0].strip().lower()
    return media if media.count(b"/") == 1 else b"text/plain"


# Connections the kernel holds for the server to accept: Twisted's default of 50 overflowed under a burst of new
# connections (clients that open one a request behind a balancer that does not pool), whose SYNs were then dropped
# and retried a second later. The kernel caps it at net.core.somaxconn (4096 on current Linux).
LISTEN_BACKLOG = 4096


def listen_endpoint(host: str, port: int) -> str:
    """Twisted's description of the listening socket: ``host`` (an IPv6 address's colons escaped), ``port``."""
    interface = host.strip("[]").replace(":", "\\:")
    return f"tcp:port={port}:interface={interface}:backlog={LISTEN_BACKLOG}"


def tcp_port(value: str) -> int:
    port = int(value) if value.strip().isdigit() else -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a whole number from 1 to 65535, not {value!r}")
    return port


def check_port(host: str, port: int) -> None:
    """A clear error, before anything loads, when ``host:port`` cannot be listened on (another server holds it)."""
    interface = host.strip("[]")
    family = socket.AF_INET6 if ":" in interface else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Twisted listens
        try:
            probe.bind((interface, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE or exc.errno == errno.EACCES:
                hint = "Stop what holds the port, or choose another (manage.py serve --port N, make run PORT=N)."
            else:  # a name that does not resolve, an address not this machine's
                hint = "Give an address of this machine (manage.py serve --host 0.0.0.0, make run HOST=…)."
            raise CommandError(f"Cannot listen on {host}:{port}: {exc.strerror}. {hint}") from None


# How often a run of refused connections is told in the log: each refused accept is an event of Twisted's own.
ACCEPT_FAILURES_EVERY_SECONDS = 60.0


class AcceptFailures:
    """Tells the log, once a minute at most, that the server could not accept connections: out of file descriptors
    (its clients are then refused or reset until connections close), or of memory for them. Twisted says so only
    in its own log, at the info level, which the server's log does not show."""

    def __init__(self) -> None:
        self.told_at: float | None = None

    def __call__(self, event: dict[str, Any]) -> None:
        said = event.get("log_format") or ""
        if said.startswith("EMFILE encountered"):
            error = "EMFILE"
        elif said.startswith("Could not accept new connection"):
            error = str(event.get("acceptError"))
        else:
            return
        if error not in _ACCEPT_FAILURES:  # ECONNABORTED: a client that left before it was accepted, nothing wrong here
            return
        now = time.monotonic()
        if self.told_at is not None and now - self.told_at < ACCEPT_FAILURES_EVERY_SECONDS:
            return
        self.told_at = now
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        logger.warning(
            "the server could not accept new connections (%s): %s; new connections are refused or reset until "
            "some close",
            error,
            _ACCEPT_FAILURES[error].format(soft=soft),
        )


_ACCEPT_FAILURES = {
    "EMFILE": "it holds as many files and sockets as it may (ulimit -n {soft})",
    "ENFILE": "the machine holds as many open files as it may (fs.file-max)",
    "ENOBUFS": "the kernel is out of memory for sockets",
    "ENOMEM": "the kernel is out of memory for sockets",
}


class Command(BaseCommand):
    help = (
        "Serve the API and the admin with daphne. "
        "In embedded mode (no REDIS_URL) this process also runs the model workers."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=tcp_port, default=8000)
        parser.add_argument("--no-warm-up", action="store_true", help="Load models on first use instead of at start")

    def handle(self, *args: Any, host: str, port: int, no_warm_up: bool, **options: Any) -> None:
        # Imported here: building the ASGI application sets Django up for serving, which no other command needs.
        from config.asgi import application

        check_port(host, port)  # before the models load: a port in use is told at once, and the exit is not 0
        if not settings.DISTRIBUTED:
            # Embedded mode has no Celery beat: this process rolls usage up and prunes it itself.
            start_periodic_rollup()
            execution.start_sweeping()  # a model taken out of the catalog has its memory freed
            self.check_runners()
            if not no_warm_up:
                dispatch.warm_up_embedded()
        http_protocol.WebRequest = _HTTPOnlyRequest
        # Connections with a deadline for reading each request, and malformed ones refused in the API's error shape.
        daphne_server.HTTPFactory = APIHTTPFactory
        twisted_http._parseContentType = media_type  # type: ignore[assignment]  # same contract
        # Twisted's table lacks some statuses the API answers with (429): their status line would read
        # "Unknown Status".
        for status in HTTPStatus:
            twisted_http.RESPONSES.setdefault(status.value, status.phrase.encode())
        mode = "distributed" if settings.DISTRIBUTED else "embedded"
        self.stderr.write(f"Serving on http://{host}:{port} ({mode} mode)", style_func=self.style.SUCCESS)
        globalLogPublisher.addObserver(AcceptFailures())  # type: ignore[arg-type]  # a callable of an event
        server = _DrainingServer(
            application=application,
            endpoints=[listen_endpoint(host, port)],
            signal_handlers=True,
            verbosity=0,
            http_timeout=settings.HTTP_TIMEOUT_SECONDS,
            application_close_timeout=10,
            server_name="b3os",
        )
        server.run()
        if not server.listening_addresses:
            raise CommandError(f"Could not listen on {host}:{port} (see the line above).")

    def check_runners(self) -> None:
        """A native runner library that crashes on this CPU stops the start with a message, not a dead server later."""
        for entry in CatalogEntry.objects.served_here():
            if (problem := check_runner(entry.runner, entry.runner_settings)) is None:
                continue
            if problem.crashed:
                raise CommandError(f"{entry.public_id}: {problem.message}")
            # One entry's bad settings must not keep the admin, where they are fixed, and the other models down.
            message = f"{entry.public_id}: {problem.message} Requests for it get 503 meanwhile."
            self.stderr.write(self.style.WARNING(message))
