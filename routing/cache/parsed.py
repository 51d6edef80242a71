"""``ParsedRequest``: the routing-relevant part of one request, built per request by
``routing.cache.prompt.parse_body``.

Its own module so that it is compiled (``routing/native.py``) while ``prompt.py``, whose msgspec
Structs a compiled module could not define, stays Python: a frozen dataclass ran the ``__init__``
``dataclasses`` wrote (``object.__setattr__`` per field) and ``prompt_chars`` was a property read
four times a request; this one's ``__init__`` is native and ``prompt_chars`` a field set once.
"""

from __future__ import annotations

from typing import Final


class ParsedRequest:
    """The routing-relevant part of one request (immutable: ``Final`` fields, checked by mypy and
    so by the mypyc build)."""

    __slots__ = (
        "max_tokens",
        "model",
        "prompt_chars",
        "prompt_text",
        "prompt_tokens_exact",
        "stream",
        "user",
    )

    def __init__(
        self,
        model: str,
        stream: bool,
        prompt_text: str,
        prompt_tokens_exact: int | None,  # a token-id prompt tells us its length exactly
        user: str | None,
        max_tokens: int | None = None,
    ) -> None:
        self.model: Final = model
        self.stream: Final = stream
        self.prompt_text: Final = prompt_text
        self.prompt_tokens_exact: Final = prompt_tokens_exact
        self.user: Final = user
        self.max_tokens: Final = max_tokens
        self.prompt_chars: Final = len(prompt_text)

    def prompt_tokens_est(self, chars_per_token: float) -> int:
        if self.prompt_tokens_exact is not None:
            return self.prompt_tokens_exact
        return int(self.prompt_chars / chars_per_token + 0.5)

    def _fields(self) -> tuple[str, bool, str, int | None, str | None, int | None]:
        return (
            self.model,
            self.stream,
            self.prompt_text,
            self.prompt_tokens_exact,
            self.user,
            self.max_tokens,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParsedRequest) or other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (
            f"ParsedRequest(model={self.model!r}, stream={self.stream!r}, prompt_text={self.prompt_text!r}, "
            f"prompt_tokens_exact={self.prompt_tokens_exact!r}, user={self.user!r}, "
            f"max_tokens={self.max_tokens!r})"
        )
