"""ASGI entry point: Django (HTTP) and Channels (WebSocket) in one application."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

django_asgi = get_asgi_application()

from controlplane.routing import websocket_urlpatterns  # noqa: E402  (needs the app registry)

application = ProtocolTypeRouter(
    {
        # Static files are served by the ASGI process itself: one process to run, no extra server.
        "http": ASGIStaticFilesHandler(django_asgi),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
