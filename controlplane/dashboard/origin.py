"""The dashboard socket's origin check: the page's own origin, port included.

Channels' ``AllowedHostsOriginValidator`` compares the ``Origin``'s host with ``ALLOWED_HOSTS`` and
ignores its port. Cookies are not per port, so a page served from any other port of an allowed
host (another dev server on the operator's laptop, a tool's web UI on the same box) could open
``/ws/dashboard/`` with the operator's session cookie and read the fleet's live telemetry. This
check runs inside it: the ``Origin`` must be the ``Host`` the handshake was sent to (host and
port), or one of ``CSRF_TRUSTED_ORIGINS`` (scheme, host and port; ``https://*.example.com`` for
subdomains), as Django's CSRF check accepts a form post. Behind a proxy that rewrites ``Host``,
list the public origin in ``CSRF_TRUSTED_ORIGINS`` (docs/deployment.md).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import is_same_domain


def same_origin(origin: str, host: str | None) -> bool:
    """Whether a handshake with this ``Origin`` sent to this ``Host`` comes from the dashboard."""
    parsed = urlsplit(origin)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return False
    netloc = parsed.netloc.lower()
    if host is not None and netloc == host.lower():
        return True  # ws:// or wss:// behind a TLS proxy: the scheme may differ, host and port may not
    for trusted in settings.CSRF_TRUSTED_ORIGINS:
        allowed = urlsplit(trusted)
        if allowed.scheme != parsed.scheme:
            continue
        pattern = allowed.netloc.lower()
        if netloc == pattern or (pattern.startswith("*.") and is_same_domain(netloc, pattern[1:])):
            return True
    return False


class SameOriginValidator:
    """ASGI middleware: refuse (403) a WebSocket handshake from any other origin (``same_origin``)."""

    def __init__(self, application: Any) -> None:
        self.application = application

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        origin = host = None
        for name, value in scope.get("headers", []):
            if name == b"origin":
                origin = value.decode("latin1")
            elif name == b"host":
                host = value.decode("latin1")
        if origin is not None and same_origin(origin, host):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)
