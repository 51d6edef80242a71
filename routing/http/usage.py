"""Token usage from a node's answer, read without slowing the answer down.

A non-streaming body is decoded for its ``usage`` object only (msgspec skips the rest at C speed).
A stream is never buffered: the gateway keeps its last few kilobytes, where vLLM's usage event
(``stream_options.include_usage``) sits just before ``data: [DONE]``.
"""

from __future__ import annotations

import msgspec

USAGE_TAIL_BYTES = 4096  # how much of a stream's end to keep for parse_stream_usage


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    """The part of OpenAI's ``usage`` object the request record keeps."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: PromptTokensDetails | None = None


class _UsageDoc(msgspec.Struct):
    usage: Usage | None = None


_usage_decoder = msgspec.json.Decoder(_UsageDoc)


def parse_usage(document: bytes) -> Usage | None:
    """The ``usage`` object of a JSON response or SSE event, if it has a readable one."""
    try:
        return _usage_decoder.decode(document).usage
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def parse_stream_usage(tail: bytes) -> Usage | None:
    """The usage of a stream from the last bytes before ``[DONE]`` (the final usage event)."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    start = tail.rfind(b"data:", 0, at)
    end = tail.find(b"\n", at)
    if start < 0 or end < 0:
        return None
    return parse_usage(tail[start + 5 : end])
