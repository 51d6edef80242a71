"""The OpenAI/vLLM wire format: request structs, response bodies, SSE chunks and errors.

Requests are decoded with msgspec (unknown fields are ignored, as vLLM accepts them); a wrong
type or value is a 400 in vLLM's error shape. Streamed chunks follow vLLM's layout (see
/work/shared/fixtures/vllm_chat_stream.txt): a role chunk, one chunk per token, a chunk carrying
``finish_reason``, an optional usage chunk with ``choices: []``, then ``data: [DONE]``. Chunks are
assembled from pre-rendered byte templates because they are written once per token.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec
from aiohttp import web

# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


class ContentPart(msgspec.Struct):
    """One part of a multi-part message; only ``{"type": "text"}`` parts are emulated."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(msgspec.Struct):
    model: str | None = None
    max_tokens: PositiveInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    n: PositiveInt = 1
    seed: int | None = None
    user: str | None = None
    stop: str | list[str] | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    # vLLM's tenant isolation: mixed into the first block's hash, so requests with other salts
    # (or none) never share cached blocks; published as the first block's ``extra_keys``.
    cache_salt: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = []
    max_completion_tokens: PositiveInt | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is text, token ids, or a one-element list of either."""

    prompt: str | list[Any] | None = None
    echo: bool = False


class TokenizeRequest(msgspec.Struct):
    """``POST /tokenize``: a completion ``prompt`` or chat ``messages`` (vLLM's two shapes)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


T = TypeVar("T")


class RequestError(Exception):
    """A client error to answer in vLLM's shape."""

    def __init__(
        self, message: str, *, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param


def decode_request(body: bytes, type_: type[T]) -> T:
    """Decode a JSON body; malformed JSON or invalid fields raise ``RequestError`` (400)."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise RequestError(f"Invalid request: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise RequestError(f"JSON decode error: {exc}") from exc


def error_response(error: RequestError, headers: dict[str, str] | None = None) -> web.Response:
    """``{"error": {"message", "type", "param", "code"}}`` with the error's status."""
    body = {
        "error": {
            "message": error.message,
            "type": error.err_type,
            "param": error.param,
            "code": error.status,
        }
    }
    return web.json_response(body, status=error.status, headers=headers, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return msgspec.json.encode(obj).decode()


def json_response(body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), content_type="application/json", headers=headers)


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, *, prompt_tokens_details: bool
) -> dict[str, Any]:
    """vLLM's usage block. vLLM adds ``prompt_tokens_details: {"cached_tokens"}`` only when
    started with ``--enable-prompt-tokens-details`` (otherwise the key is ``null``)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens} if prompt_tokens_details else None,
    }


def chat_completion_body(
    request_id: str, created: int, model: str, text: str, finish_reason: str | None, usage_: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_,
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def completion_body(
    request_id: str, created: int, model: str, text: str, finish_reason: str | None, usage_: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_,
        "kv_transfer_params": None,
    }


class ChunkRenderer:
    """SSE chunks of one streamed answer, from byte templates (one JSON encode per token)."""

    __slots__ = ("_head", "_is_chat", "_token_tail", "_top")

    def __init__(self, *, chat: bool, request_id: str, created: int, model: str) -> None:
        self._is_chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._top = (
            f'{{"id":"{request_id}","object":"{obj}","created":{created},"model":'.encode()
            + msgspec.json.encode(model)
        )
        if chat:
            self._head = b"data: " + self._top + b',"choices":[{"index":0,"delta":{"content":'
            self._token_tail = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        else:
            self._head = b"data: " + self._top + b',"choices":[{"index":0,"text":'
            self._token_tail = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'

    def role(self) -> bytes:
        """The chat stream's first chunk (vLLM sends it with the first output)."""
        return (
            b"data: "
            + self._top
            + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
            b'"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n'
        )

    def token(self, text: str) -> bytes:
        return self._head + msgspec.json.encode(text) + self._token_tail

    def finish(self, finish_reason: str) -> bytes:
        reason = msgspec.json.encode(finish_reason)
        if self._is_chat:
            return (
                self._head
                + b'""},"logprobs":null,"finish_reason":'
                + reason
                + b',"stop_reason":null,"token_ids":null}]}\n\n'
            )
        return self._head + b'"","logprobs":null,"finish_reason":' + reason + b',"stop_reason":null}]}\n\n'

    def usage(self, usage_: dict[str, Any]) -> bytes:
        return b"data: " + self._top + b',"choices":[],"usage":' + msgspec.json.encode(usage_) + b"}\n\n"

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"
