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

# Each app keeps its WebSocket routes in its own routing.py (the Channels convention); this is
# where they are mounted, as urls.py mounts the HTTP ones. (The gateway package is ``routing``:
# no project-level module of that name, so the two are never confused.)
from controlplane.dashboard.origin import SameOriginValidator  # noqa: E402
from controlplane.dashboard.routing import websocket_urlpatterns  # noqa: E402  (needs the app registry)

application = ProtocolTypeRouter(
    {
        # Static files are served by the ASGI process itself: one process to run, no extra server.
        "http": ASGIStaticFilesHandler(django_asgi),
        # The Origin's host among ALLOWED_HOSTS, then its port too (controlplane/dashboard/origin.py).
        "websocket": AllowedHostsOriginValidator(
            SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
        ),
    }
)
