"""ASGI entry point: HTTP to Django (with the admin's static files), WebSocket upgrades refused."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_application = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from inference.websocket import refuse_websocket  # noqa: E402

application = ProtocolTypeRouter(
    {"http": ASGIStaticFilesHandler(django_application), "websocket": refuse_websocket}
)
