"""Who may use the gateway: the client key of a request, checked against the key set.

A key comes as ``Authorization: Bearer <key>`` (OpenAI's SDKs) or ``api-key: <key>`` (Azure
OpenAI's SDKs). Answers, in OpenAI's shape: 401 ``invalid_api_key`` (missing, unknown, revoked,
expired key), 403 (a model or gateway region the key may not use). Pure: the key set and the
clock come in, nothing is read from Redis here.
"""

from __future__ import annotations

from typing import Final

from routing.contract import ClientKeySpec
from routing.errors import GatewayError
from routing.frontdoor.keystore import KeyStore

MISSING: Final = "missing"
INVALID: Final = "invalid"
REVOKED: Final = "revoked"
EXPIRED: Final = "expired"
MODEL_NOT_ALLOWED: Final = "model_not_allowed"
REGION_NOT_ALLOWED: Final = "region_not_allowed"


class AuthError(GatewayError):
    """A refused key, with the metric reason."""

    def __init__(
        self,
        status: int,
        message: str,
        reason: str,
        *,
        code: str,
        param: str | None = None,
        key: ClientKeySpec | None = None,
    ) -> None:
        GatewayError.__init__(self, status, message, code=code, param=param)
        self.reason = reason
        # The key the secret belongs to, when it is one the key set knows (revoked, expired, or
        # not allowed): the refusal is then counted and recorded for that key. Never set for a
        # secret that matched no key, so made-up ids cannot add anything (issue 22, item 10).
        self.key = key


def presented_secret(authorization: bytes | None, api_key: bytes | None) -> str | None:
    """The secret from ``Authorization: Bearer ...`` or ``api-key``, or ``None``."""
    if authorization is not None:
        scheme, _, value = authorization.partition(b" ")
        if scheme.lower() == b"bearer" and value.strip():
            return value.strip().decode("latin-1")
    if api_key is not None and api_key.strip():
        return api_key.strip().decode("latin-1")
    return None


def authenticate(store: KeyStore, secret: str | None, now_s: float) -> ClientKeySpec:
    """The key behind ``secret``; ``AuthError`` (401) when there is none that may be used now."""
    if secret is None:
        raise AuthError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            MISSING,
            code="invalid_api_key",
        )
    key = store.lookup(secret)
    if key is None:
        shown = secret[:12] + "..." if len(secret) > 12 else "***"
        raise AuthError(401, f"Incorrect API key provided: {shown}.", INVALID, code="invalid_api_key")
    if key.revoked:
        raise AuthError(
            401, f"The API key {key.id} has been revoked.", REVOKED, code="invalid_api_key", key=key
        )
    if key.expires_at is not None and key.expires_at <= now_s:
        raise AuthError(401, f"The API key {key.id} has expired.", EXPIRED, code="invalid_api_key", key=key)
    return key


def authorize(key: ClientKeySpec, model: str, region: str) -> None:
    """403 unless ``key`` may use ``model`` through a gateway in ``region``."""
    if key.models and model not in key.models:
        raise AuthError(
            403,
            f"The API key {key.id} may not use the model `{model}`.",
            MODEL_NOT_ALLOWED,
            code="model_not_allowed",
            param="model",
        )
    if key.regions and region not in key.regions:
        raise AuthError(
            403,
            f"The API key {key.id} may not be used in region {region}.",
            REGION_NOT_ALLOWED,
            code="region_not_allowed",
        )
