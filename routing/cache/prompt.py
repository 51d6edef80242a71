"""What the gateway reads from a request body, and the prefix-index hook.

The gateway forwards the client's body bytes unchanged; it decodes only the few fields it routes by
(model, stream, the prompt, ``user``) into small msgspec structs (``routing.cache.bodies``), which
skip everything else at C speed. Compiled (``routing/native.py``): the parse runs per request.

The "prompt text" is a stable rendering of the prompt: for chat, each message's role and content
in order, so two conversations that share their first turns share a prefix of the text. Prefix
indexes (``PrefixIndex``) match on that text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, Literal, Protocol

import msgspec

from routing.cache.bodies import ChatBody, ChatMessage, CompletionBody, EmbeddingBody
from routing.cache.parsed import ParsedRequest
from routing.contract import NodeSpec

Endpoint = Literal["chat", "completions", "embeddings"]

DEFAULT_CHARS_PER_TOKEN: Final = 4.0


_chat_decoder = msgspec.json.Decoder(ChatBody)
_embedding_decoder = msgspec.json.Decoder(EmbeddingBody)
_completion_decoder = msgspec.json.Decoder(CompletionBody)


class BodyError(ValueError):
    """The body is not JSON, or lacks (or mistypes) a field the gateway needs."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def parse_body(endpoint: Endpoint, body: bytes) -> ParsedRequest:
    """Decode the routing fields of a request body; raise ``BodyError`` with a client-facing message."""
    try:
        if endpoint == "chat":
            chat = _chat_decoder.decode(body)
            if not chat.messages:
                raise BodyError("'messages' must contain at least one message", "messages")
            stream_options = chat.stream_options
            parsed = ParsedRequest(
                chat.model,
                bool(chat.stream),
                render_messages(chat.messages),
                None,
                chat.user,
                chat.max_completion_tokens or chat.max_tokens,
            )
        elif endpoint == "embeddings":
            embedding = _embedding_decoder.decode(body)
            text, exact = render_prompt(embedding.input)
            stream_options = None
            parsed = ParsedRequest(embedding.model, False, text, exact, embedding.user)
        else:
            completion = _completion_decoder.decode(body)
            stream_options = completion.stream_options
            if completion.prompt is None:
                raise BodyError("Invalid request body: Object missing required field `prompt`", "prompt")
            text, exact = render_prompt(completion.prompt)
            parsed = ParsedRequest(
                completion.model, bool(completion.stream), text, exact, completion.user, completion.max_tokens
            )
    except msgspec.ValidationError as exc:
        raise BodyError(_describe_validation(exc), _param_of(exc)) from None
    except msgspec.DecodeError as exc:
        if "UTF-8" in str(exc):  # msgspec 0.23 and later check strings as they decode them
            raise BodyError("The request body is not valid UTF-8 JSON.", _param_of_bad_utf8(body)) from None
        raise BodyError("The request body is not valid JSON.") from None
    except UnicodeDecodeError:
        # msgspec before 0.23 hands back strings it has not checked; the first use of a non-UTF-8 one fails.
        raise BodyError("The request body is not valid UTF-8 JSON.", _param_of_bad_utf8(body)) from None
    except RecursionError:
        raise BodyError("The request body nests JSON too deeply.") from None
    if not parsed.model:
        raise BodyError("'model' must be a non-empty string", "model")
    if stream_options is not None and not parsed.stream:
        raise BodyError("Stream options can only be defined when `stream=True`.", "stream_options")
    return parsed


def render_messages(messages: Sequence[ChatMessage]) -> str:
    """Render chat messages as role-tagged text, in order (a stable prefix for shared history)."""
    parts: list[str] = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content if part.text is not None)
        parts.append(f"<|{message.role}|>\n{content or ''}\n")
    return "".join(parts)


def render_prompt(prompt: str | list[str | int | list[int]]) -> tuple[str, int | None]:
    """Render a completions prompt; token-id prompts also return their exact token count."""
    if isinstance(prompt, str):
        return prompt, None
    if all(isinstance(item, str) for item in prompt):
        return "\n".join(prompt), None  # type: ignore[arg-type]
    ids: list[int] = []
    for item in prompt:
        if isinstance(item, int):
            ids.append(item)
        elif isinstance(item, list):
            ids.extend(item)
        else:
            raise BodyError("'prompt' mixes text and token ids", "prompt")
    return " ".join(map(str, ids)), len(ids)


def _describe_validation(exc: msgspec.ValidationError) -> str:
    # msgspec says e.g. "Object missing required field `model`" or "Expected `str`, got `int` -
    # at `$.model`": precise, and free of internals, so it is safe to show the client.
    return f"Invalid request body: {exc}"


def _param_of_bad_utf8(body: bytes) -> str | None:
    """The field holding the first invalid UTF-8 string (error path only, so it may be slow)."""
    try:
        document = msgspec.json.decode(body.decode("utf-8", "replace"))
    except (msgspec.DecodeError, RecursionError):
        return None
    pending: list[tuple[str, object]] = [("", document)]
    while pending:
        path, value = pending.pop(0)
        if isinstance(value, str):
            if "\ufffd" in value:
                return path or None
        elif isinstance(value, dict):
            for key, item in value.items():
                if "\ufffd" in key:
                    return path or None
                pending.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{index}]", item) for index, item in enumerate(value))
    return None


def _param_of(exc: msgspec.ValidationError) -> str | None:
    text = str(exc)
    if "at `$." in text:
        return text.rsplit("at `$.", 1)[1].rstrip("`")
    if "required field `" in text:
        return text.rsplit("required field `", 1)[1].rstrip("`")
    return None


class PrefixIndex(Protocol):
    """Estimates how much of a prompt each node already holds in its KV cache.

    The gateway calls ``match`` before routing and ``insert`` after each decision (both only while
    the policy's algorithm has ``needs_prefix_matches``), ``observe`` when a node reported how many
    prompt tokens it had cached, and ``sync_nodes``/``set_chars_per_token`` when a new snapshot
    arrives. Implementations must be fast and never do I/O in these calls: they run on the
    request path. ``routing.cache.approx_index.ApproxPrefixIndex`` is the production implementation.
    """

    def match(
        self, node_ids: Sequence[int], prompt_text: str, prompt_ids: Sequence[int] | None = None
    ) -> dict[int, int]:
        """Node id -> estimated cached prefix length in tokens, for the nodes given.

        ``prompt_ids``: the prompt's token ids, when the model has a tokenizer (precise matching).
        """
        ...

    def insert(self, node_id: int, prompt_text: str) -> None:
        """Record that ``prompt_text`` was sent to ``node_id`` (its cache will hold it)."""
        ...

    def text_hashes(self, prompt_text: str) -> list[int]:
        """The prompt's chained chunk hashes (``routing.cache.approx_index.chunk_hashes``), computed
        once per prompt object: ``match``, ``insert`` and the request's record share them."""
        ...

    def observe(
        self, node_id: int, predicted_fraction: float, observed_fraction: float, now_s: float
    ) -> None:
        """Feed back the cached fraction the node reported against the one the index predicted."""
        ...

    def sync_nodes(self, nodes: Iterable[NodeSpec]) -> None:
        """The fleet changed: size nodes to their KV capacity, forget nodes that left."""
        ...

    def set_chars_per_token(self, chars_per_token: float) -> None:
        """The policy's characters-per-token ratio changed."""
        ...
