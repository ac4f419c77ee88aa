"""ASGI entry point: HTTP to Django (with the admin's static files), WebSocket upgrades refused.

API requests take a shorter way through Django's ASGI handler. Django sends ``request_started`` and
closes each response through a thread of the request's own, so that sync signal receivers (closing
stale database connections) run where the request's database connection lives. The API never
touches the database from a request thread (its queries run on the shared pool, whose threads
check their own connections, see ``core.db``), so those two thread hops are pure cost there.
"""

import asyncio
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django.setup(set_prefix=False)

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.exceptions import RequestAborted, SuspiciousFileOperation  # noqa: E402
from django.core.handlers.asgi import ASGIHandler, get_script_prefix  # noqa: E402
from django.http import Http404  # noqa: E402
from django.urls import set_script_prefix  # noqa: E402

from inference.api.errors import is_api_path  # noqa: E402
from inference.api.websocket import refuse_websocket  # noqa: E402


class Handler(ASGIHandler):
    async def handle(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if not is_api_path(scope.get("path", "")):
            return await super().handle(scope, receive, send)
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            return

        async def process_request() -> object:
            response = await self.run_get_response(request)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass  # the client went away while the response was being sent
            finally:
                # A streamed answer's own stream, which Django leaves open (see ``render_result``); one whose sending
                # never began is settled as the client's hang-up.
                if (source := getattr(response, "source", None)) is not None:
                    await source.aclose()
            return response

        # As Django does: a client that disconnects cancels the response (and so the generation), here with the
        # reason the server gave, if any (its own timeout), for the usage record.
        listener = asyncio.create_task(_disconnected(receive))
        responder = asyncio.create_task(process_request())
        await asyncio.wait([listener, responder], return_when=asyncio.FIRST_COMPLETED)
        reason = listener.result() if listener.done() and listener.exception() is None else None
        for task in (listener, responder):
            if not task.done():
                task.cancel(reason)
            try:
                await task
            except (asyncio.CancelledError, RequestAborted):
                pass
        if not responder.cancelled() and responder.exception() is None:
            responder.result().close()
        body_file.close()


async def _disconnected(receive) -> str | None:  # type: ignore[no-untyped-def]
    """Waits for the client's ``http.disconnect`` and returns the reason it gives, if any."""
    while (message := await receive())["type"] != "http.disconnect":
        pass  # the body was read whole before: nothing else is sent
    reason = message.get("reason")
    return reason if isinstance(reason, str) else None


class StaticFiles(ASGIStaticFilesHandler):
    """The admin's static files; a path that climbs out of their folder (``/static/../config/settings.py``) is not
    found, as any other file not there, rather than a 500 with a traceback in the log."""

    def serve(self, request):  # type: ignore[no-untyped-def]
        try:
            return super().serve(request)
        except SuspiciousFileOperation:
            raise Http404("no such static file") from None


application = ProtocolTypeRouter({"http": StaticFiles(Handler()), "websocket": refuse_websocket})
