"""The control plane's connections to Redis: one client per process, the key names it uses, and
the back-off of the request path."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache

import redis
from django.conf import settings

from routing.contract import RedisKeys

log = logging.getLogger(__name__)


@cache
def redis_client() -> redis.Redis:
    """The control plane's Redis client (one per process; short timeouts so the API fails fast)."""
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2.0, socket_connect_timeout=2.0)


def redis_keys() -> RedisKeys:
    """Key and channel names under this deployment's prefix (``GORGO_REDIS_PREFIX``)."""
    return RedisKeys(prefix=settings.GORGO_REDIS_PREFIX)


class RequestPathBackoff:
    """Redis on an API request's path (the sign-in throttle, the keys' last-used times) is optional:
    the request is answered without it. When Redis hangs (a SIGSTOPped or partitioned server
    accepts connections and never answers) every such read paid the client's timeout: each API
    call took 2 s. After a failure the request path skips Redis for ``GORGO_REDIS_BACKOFF_S``; one
    request then tries again. One warning per outage, one line when Redis answers again.

    One per process (``request_path_backoff()``); the clock is injectable for tests.
    """

    def __init__(self, backoff_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.backoff_s = backoff_s
        self.clock = clock
        self.until = 0.0
        self.down = False
        self._lock = threading.Lock()

    def available(self) -> bool:
        return self.clock() >= self.until

    def failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.until = self.clock() + self.backoff_s
            if self.down:
                return
            self.down = True
        log.warning(
            "Redis unreachable (%s: %s); API requests go on without it, retrying every %.0f s",
            what,
            exc,
            self.backoff_s,
        )

    def succeeded(self) -> None:
        if not self.down:
            return
        with self._lock:
            self.down = False
        log.info("Redis reachable again; the API uses it again")

    @contextmanager
    def attempt(self, what: str) -> Iterator[bool]:
        """``with backoff.attempt("sign-in throttle") as go:`` -- go is False while backing off;
        a Redis error inside is recorded (and swallowed: the caller answers without Redis)."""
        if not self.available():
            yield False
            return
        try:
            yield True
        except redis.RedisError as exc:
            self.failed(what, exc)
        else:
            self.succeeded()


@cache
def request_path_backoff() -> RequestPathBackoff:
    return RequestPathBackoff(settings.GORGO_REDIS_BACKOFF_S)
