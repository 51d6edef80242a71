"""The request bodies' msgspec structs: the fields the gateway routes by or validates.

Apart from ``routing.cache.prompt``, which decodes with them, because that module is compiled
(``routing/native.py``) and msgspec reads no field of a Struct defined in a compiled module (mypyc
turns the annotations into something msgspec does not read).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class ContentPart(msgspec.Struct):
    """One part of a multi-part chat message; only text parts count toward the prompt."""

    type: str = ""
    text: str | None = None


# The roles OpenAI's API and vLLM's chat templates know; anything else is a 400 there too.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(msgspec.Struct):
    role: Role
    content: str | list[ContentPart] | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


# The sampling fields vLLM validates itself (its 400s), checked here at C speed by msgspec so
# a bad request never costs a node round trip. Every other field passes through unread.
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Count = Annotated[int, msgspec.Meta(ge=1, le=128)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]


class _Sampling(msgspec.Struct):
    """Fields both endpoints share."""

    model: str
    stream: bool | None = None
    user: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Count | None = None
    max_tokens: MaxTokens | None = None
    stop: str | list[str] | None = None
    stream_options: StreamOptions | None = None


class ChatBody(_Sampling):
    """The fields of a ``/v1/chat/completions`` body the gateway routes by or validates."""

    messages: list[ChatMessage] = []
    max_completion_tokens: MaxTokens | None = None


class CompletionBody(_Sampling):
    """The fields of a ``/v1/completions`` body the gateway routes by or validates."""

    prompt: str | list[str | int | list[int]] | None = None


class EmbeddingBody(msgspec.Struct):
    """The fields of a ``/v1/embeddings`` body the gateway routes by (routed by load, never by prefix)."""

    model: str
    input: str | list[str | int | list[int]]
    user: str | None = None
