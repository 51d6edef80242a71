"""The front door of the inference endpoints: client key, scope, concurrency and rate limits.

``Proxy`` calls ``authenticate`` before reading a body (a stranger's body is not worth reading),
``admit`` once the model and prompt size are known, and ``done`` when the request is over. Each
refusal is counted (``gorgo_gateway_auth_failures_total``, ``gorgo_gateway_rate_limited_total``).
The only I/O is a Redis call when this gateway's lease of a key's rate or concurrency limits
is used up (leases are taken and renewed so that the steady state makes none).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from routing.contract import ClientKeySpec
from routing.errors import GatewayError
from routing.frontdoor.auth import AuthError, authenticate, authorize, presented_secret
from routing.frontdoor.concurrency import ConcurrencyLimiter
from routing.frontdoor.keystore import KeyStore
from routing.frontdoor.ratelimit import RateLimiter, header_lines
from routing.http.headers import RequestHeaders
from routing.http.usage import Usage
from routing.observability.exporter import GatewayMetrics

CONCURRENCY: Final = "concurrency"
# Credentials already checked against the current key set, at most this many (then forgotten).
_KNOWN_CREDENTIALS_MAX: Final = 10_000
# ... each of at most this many bytes (both header values): a secret is ~70 ("Bearer gorgo-sk-...").
# Longer ones (a valid key padded with spaces, or beside a junk ``api-key``) are checked every time:
# kept whole, 10,000 such values of 60 kB held 600 MB.
_KNOWN_CREDENTIAL_MAX_BYTES: Final = 512


class Grant:
    """What ``admit`` granted one request: undone by ``done``. ``head``: its ``x-ratelimit-*``
    headers as the answer's head bytes (``ratelimit.header_lines``; empty for a key without limits).
    ``served``: a node began a 200 answer (the proxy sets it), so its tokens were spent even if the
    request then ends in a 499, 502 or 504. ``stream_events``: the ``data: {`` events of its stream
    the relay passed on (counted for a key with a tokens/min limit): a stream's completion tokens
    when it has no usage event, one token an event as vLLM and OpenAI stream them (a choice's
    first and last event may carry none; an event of several tokens counts one)."""

    __slots__ = ("charged_tokens", "head", "served", "stream_events")

    def __init__(self, charged_tokens: int, head: bytes) -> None:
        self.charged_tokens = charged_tokens
        self.head = head
        self.served = False
        self.stream_events = 0


class FrontDoor:
    """Client keys and their limits, for one gateway process."""

    def __init__(
        self,
        region: str,
        store: KeyStore,
        limiter: RateLimiter,
        concurrency: ConcurrencyLimiter,
        metrics: GatewayMetrics,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._region = region
        self._clock = clock  # unix seconds: key expiry; tests pass one they can move
        self.store = store
        self.limiter = limiter
        self.concurrency = concurrency
        self._metrics = metrics
        # (Authorization, api-key) header values -> the key they named in the key set
        # ``_known_for``: a returning client skips parsing and hashing its secret. Only accepted
        # credentials are kept (a stranger cannot fill it), and a new key set empties it, so a
        # revoked key is refused from the next key set on. Expiry is checked on every request.
        self._known: dict[tuple[bytes | None, bytes | None], ClientKeySpec] = {}
        self._known_for: object = None

    def authenticate(self, headers: RequestHeaders) -> ClientKeySpec:
        credential = (headers.authorization, headers.api_key)
        by_hash = self.store.by_hash
        if self._known_for is by_hash:
            key = self._known.get(credential)
            if key is not None and (key.expires_at is None or key.expires_at > self._clock()):
                return key
        else:
            self._known = {}
            self._known_for = by_hash
        try:
            key = authenticate(
                self.store, presented_secret(headers.authorization, headers.api_key), self._clock()
            )
        except AuthError as exc:
            self._metrics.auth_failure(exc.reason)
            if exc.key is not None:  # a known key, refused: counted for it (bounded by the key set)
                self._metrics.key_request(exc.key.id, exc.key.priority, exc.status)
            raise
        if len(headers.authorization or b"") + len(headers.api_key or b"") > _KNOWN_CREDENTIAL_MAX_BYTES:
            return key  # accepted, not remembered (see _KNOWN_CREDENTIAL_MAX_BYTES)
        if len(self._known) >= _KNOWN_CREDENTIALS_MAX:
            self._known = {}
        self._known[credential] = key
        return key

    async def admit(self, key: ClientKeySpec, model: str, prompt_tokens_est: int) -> Grant:
        """Scope, concurrency and rate checks; the request counts toward the key's limits after."""
        if key.models or key.regions:
            try:
                authorize(key, model, self._region)
            except AuthError as exc:
                self._metrics.auth_failure(exc.reason)
                raise
        slot = key.max_concurrent is not None
        if slot:
            self.limiter.prefetch(key)  # a first rate lease comes during the slot's call, not after
        if slot and not await self.concurrency.acquire(key):
            self._metrics.rate_limited(key.id, CONCURRENCY)
            raise GatewayError(
                429,
                f"Too many concurrent requests for API key {key.id} (limit {key.max_concurrent}).",
                code="rate_limit_exceeded",
                retry_after_s=1,
            )
        head = b""
        charged = 0
        if key.requests_per_min or key.tokens_per_min:
            leased = self.limiter.head_from_lease(key, prompt_tokens_est)  # the common case: no I/O
            if leased is None:
                try:
                    head = header_lines(await self._check(key, prompt_tokens_est))
                except BaseException:
                    if slot:
                        self.concurrency.release(key)
                    raise
            else:
                head = leased
            # What the limiter charged: a prompt above a whole minute's tokens is charged that
            # minute only (the script's and the local buckets' cap), so settling must start there.
            charged = min(prompt_tokens_est, key.tokens_per_min) if key.tokens_per_min else 0
        self.store.used.add(key.id)
        return Grant(charged, head)

    async def _check(self, key: ClientKeySpec, prompt_tokens_est: int) -> list[tuple[bytes, bytes]]:
        """The rate limits when this gateway's lease does not cover the request: Redis; 429 if used up."""
        verdict = await self.limiter.check(key, prompt_tokens_est)
        if not verdict.allowed:
            self._metrics.rate_limited(key.id, verdict.reason or "requests")
            limit = key.requests_per_min if verdict.reason == "requests" else key.tokens_per_min
            raise GatewayError(
                429,
                f"Rate limit reached for API key {key.id} on {verdict.reason} per min: limit {limit}. "
                f"Please try again in {verdict.retry_after_s:.3g}s.",
                code="rate_limit_exceeded",
                retry_after_s=verdict.retry_after_s,
                extra_headers=verdict.headers,
            )
        return verdict.headers

    def done(
        self, key: ClientKeySpec, grant: Grant | None, usage: Usage | None, status: int, sent: bool = False
    ) -> None:
        """The request is over: free its concurrency slot, settle its tokens, count it. ``sent``:
        it was handed to a node (which then prefilled its prompt, answer or not)."""
        self._metrics.key_request(key.id, key.priority, status)
        if grant is None:
            return
        if key.max_concurrent is not None:  # the same key object admit took a slot for
            self.concurrency.release(key)
        if grant.charged_tokens or key.tokens_per_min:
            if usage is not None and usage.prompt_tokens is not None:
                used = usage.prompt_tokens + (usage.completion_tokens or 0)
            elif status >= 400 and not grant.served and not (status == 499 and sent):
                # No node answered it (refused, or a node failed): give the charge back. Not to a
                # client that hung up after its request reached a node: the node took its prompt
                # on (vLLM prefills until it sees the abort), and a refund made long prompts cut
                # before their first token free of a tokens/min limit.
                used = 0
            else:
                # A stream without a usage event, or one cut midway (the client left, the node
                # broke): the estimate plus the events it streamed. (A cut stream was given its
                # charge back as if no node had served it, and a stream without a usage event, as
                # OpenAI's SDKs stream by default, was charged its prompt only: its completion
                # tokens were free.)
                used = grant.charged_tokens + grant.stream_events
            self.limiter.settle(key, grant.charged_tokens, used)
