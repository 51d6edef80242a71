"""Errors the gateway answers itself, in OpenAI's (and vLLM's) shape.

``{"error": {"message": ..., "type": ..., "param": ..., "code": <status>}}``: the type names follow
vLLM (``BadRequestError``, ``NotFoundError``...), so clients and SDKs map them like a node's own.
Messages are written for the client; internals (stack traces, exception reprs) never go out.
"""

from __future__ import annotations

import msgspec

from routing.contract import encode

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

JSON_CONTENT_TYPE = (b"content-type", b"application/json")


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


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
        retry_after_s: int | None = None,
        node_name: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.node_name = node_name  # the node that failed, for 502/504

    def body(self) -> bytes:
        detail = ErrorDetail(self.message, ERROR_TYPES.get(self.status, "Error"), self.param, self.status)
        return encode(ErrorBody(detail))

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [JSON_CONTENT_TYPE]
        if self.retry_after_s is not None:
            headers.append((b"retry-after", str(self.retry_after_s).encode()))
        return headers
