"""Token usage from a node's answer: the msgspec structs ``routing.http.usage_read`` decodes into.

Apart from the reading code because that is compiled (``routing/native.py``) and msgspec reads no
field of a Struct defined in a compiled module (as with ``routing.cache.bodies``).
"""

from __future__ import annotations

import msgspec

USAGE_TAIL_BYTES = 4096  # how much of a stream's end to keep for usage_read.parse_stream_usage


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    """The part of OpenAI's ``usage`` object the request record keeps."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: PromptTokensDetails | None = None


class UsageDoc(msgspec.Struct):
    """A JSON answer or SSE event, for its ``usage`` object only."""

    usage: Usage | None = None


class NodeError(msgspec.Struct):
    """The part of a node's error object (OpenAI's and vLLM's shape) the request record keeps."""

    message: str = ""
    code: int | str | None = None  # vLLM: the HTTP status it stands for


class ErrorEvent(msgspec.Struct):
    """An SSE event, for its ``error`` object only (vLLM's error event ending a stream)."""

    error: NodeError | None = None
