"""Token usage from a node's answer, read without slowing the answer down.

A non-streaming body is decoded for its ``usage`` object only (msgspec skips the rest at C speed).
A stream is never buffered: the gateway keeps its last few kilobytes (``USAGE_TAIL_BYTES``), where
vLLM's usage event (``stream_options.include_usage``) sits just before ``data: [DONE]``.

Compiled (``routing/native.py``): read once per answered request; the structs it decodes into are
``routing.http.usage``'s.
"""

from __future__ import annotations

from typing import Final

import msgspec

from routing.http.usage import ErrorEvent, NodeError, Usage, UsageDoc

_usage_decoder: Final = msgspec.json.Decoder(UsageDoc)
_error_decoder: Final = msgspec.json.Decoder(ErrorEvent)


def parse_usage(document: bytes) -> Usage | None:
    """The ``usage`` object of a JSON response or SSE event, if it has a readable one."""
    try:
        doc: UsageDoc = _usage_decoder.decode(document)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return doc.usage


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


def parse_stream_error(tail: bytes) -> NodeError | None:
    """The node's own error event, when it ended the stream (vLLM: ``data: {"error": {...}}`` then
    ``data: [DONE]``, its status already 200). ``{"error"`` only starts an object whose first key
    is ``error``: inside a JSON string its quote would be escaped."""
    at = tail.rfind(b'{"error"')
    if at < 0:
        return None
    end = tail.find(b"\n", at)
    if end < 0:
        return None
    rest = tail[end:].strip()
    if rest and rest != b"data: [DONE]":  # not the last event: the stream went on after it
        return None
    try:
        event: ErrorEvent = _error_decoder.decode(tail[at:end])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return event.error
