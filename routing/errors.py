"""Errors the gateway answers itself, in OpenAI's (and vLLM's) shape.

``{"error": {"message": ..., "type": ..., "param": ..., "code": <status>}}``: the type names follow
vLLM (``BadRequestError``, ``NotFoundError``...), so clients and SDKs map them like a node's own.
Messages are written for the client; internals (stack traces, exception reprs) never go out.
"""

from __future__ import annotations

import math

import msgspec

from routing.contract import encode

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

JSON_CONTENT_TYPE = (b"content-type", b"application/json")


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int | str  # the status, or OpenAI's code where clients look for one (invalid_api_key...)


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class GatewayError(Exception):
    """A request the gateway answers with an error status instead of a node's response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
        node_name: str | None = None,
        code: str | None = None,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.node_name = node_name  # the node that failed, for 502/504
        self.code = code
        self.extra_headers = extra_headers

    def body(self) -> bytes:
        detail = ErrorDetail(
            self.message,
            ERROR_TYPES.get(self.status, "Error"),
            self.param,
            self.code if self.code is not None else self.status,
        )
        return encode(ErrorBody(detail))

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [JSON_CONTENT_TYPE]
        if self.retry_after_s is not None:
            # Whole seconds (RFC 9110), rounded up; and milliseconds, which OpenAI's SDKs prefer.
            headers.append((b"retry-after", str(max(1, math.ceil(self.retry_after_s))).encode()))
            headers.append((b"retry-after-ms", str(max(1, round(self.retry_after_s * 1000))).encode()))
        if self.extra_headers:
            headers.extend(self.extra_headers)
        return headers
