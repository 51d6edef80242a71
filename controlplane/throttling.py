"""Failed sign-ins and bad API tokens, throttled per client address.

Both kinds of failure count against one Redis counter per address (``RedisKeys.auth_failures``,
expiring ``GORGO_AUTH_FAILURE_WINDOW_S`` after the first failure). At ``GORGO_AUTH_FAILURES``
failures the address is refused until the window ends: password logins (admin and dashboard)
fail even with the right password, token requests answer 429 with ``Retry-After``. A guessing
attack gets ten tries, not thousands. When Redis is unreachable, nothing is throttled (sign-in
must not depend on it), a warning is logged once per outage, and for ``GORGO_REDIS_BACKOFF_S``
after a failure requests do not try Redis at all (a hung Redis cost every API call 2 s).

Our own counter rather than django-axes: token failures never pass through django.contrib.auth,
and one counter covers both paths with the Redis the control plane already has.
"""

from __future__ import annotations

import ipaddress
import logging

from django.conf import settings
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication, get_authorization_header

from controlplane.connections import redis_client, redis_keys, request_path_backoff

log = logging.getLogger(__name__)


def client_address(request: HttpRequest) -> str:
    """The address failures count against: the peer, unless the peer is a trusted proxy
    (``GORGO_TRUSTED_PROXIES``); then the nearest X-Forwarded-For hop that is not one.

    Walking from the right, because each proxy appends the address it saw: the left part of the
    header is whatever the client wrote, and a client that could choose its address would never
    reach the limit."""
    peer = request.META.get("REMOTE_ADDR") or "unknown"
    if not _is_trusted_proxy(peer):
        return peer
    hops = [hop.strip() for hop in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if hop.strip()]
    for hop in reversed(hops):
        if not _is_trusted_proxy(hop):
            return hop
    return peer


def _is_trusted_proxy(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in settings.GORGO_TRUSTED_PROXIES)


def is_throttled(request: HttpRequest) -> bool:
    failures = None
    with request_path_backoff().attempt("sign-in throttle") as go:
        if go:
            failures = redis_client().get(redis_keys().auth_failures(client_address(request)))
    return failures is not None and int(failures) >= settings.GORGO_AUTH_FAILURES


def record_failure(request: HttpRequest) -> None:
    key = redis_keys().auth_failures(client_address(request))
    with request_path_backoff().attempt("counting a failed sign-in") as go:
        if go:
            pipe = redis_client().pipeline(transaction=True)
            pipe.set(key, 0, ex=int(settings.GORGO_AUTH_FAILURE_WINDOW_S), nx=True)  # the window starts
            pipe.incr(key)  # keeps the expiry
            pipe.execute()


class ThrottledModelBackend(ModelBackend):
    """Django's password backend, refusing an address with too many recent failures."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None:  # not a web sign-in (a management command, a test client login)
            return super().authenticate(request, username=username, password=password, **kwargs)
        if is_throttled(request):
            log.warning("sign-in from %s refused: too many failures", client_address(request))
            raise PermissionDenied("too many failed sign-ins")
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is None:
            record_failure(request)
        return user


class ThrottledTokenAuthentication(TokenAuthentication):
    """DRF's token authentication; an address sending too many bad tokens gets 429."""

    def authenticate(self, request):
        header = get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        if is_throttled(request):
            raise exceptions.Throttled(
                wait=settings.GORGO_AUTH_FAILURE_WINDOW_S, detail="Too many failed sign-ins; try again later."
            )
        try:
            return super().authenticate(request)
        except exceptions.AuthenticationFailed:
            record_failure(request)
            raise
