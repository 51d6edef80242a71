"""A deterministic approximate tokenizer, so prompt token counts are plausible for English text.

Rules (documented in docs/simulator.md):

1. Llama-3's special tokens (``<|begin_of_text|>``, ``<|start_header_id|>`` ...) are split out
   first and keep Llama-3's ids, as a Hugging Face tokenizer does; the text between them is
   tokenized piece by piece.
2. Text is cut into pieces with a GPT-style pattern: a letter run with an optional leading space
   (`` hello``), a run of one to three digits, a punctuation run with an optional leading space,
   a run of line breaks (with the blanks before them), or another whitespace run.
3. Letter runs longer than ``MAX_LETTERS_PER_TOKEN`` are split into chunks of that size, which
   is what a byte-pair vocabulary does to rare long words. English prose comes out near 1.3
   tokens per word.
4. A piece's id comes from the vocabulary of the emulated model's ``tokenizer.json``
   (``simulator/model_files/``, written by ``simulator.model_folder``: every piece the emulated
   model and the workloads produce) so a Hugging Face tokenizer loaded from that file gives the
   same ids; any other piece gets a stable hash (BLAKE2b, not Python's salted ``hash()``) into
   Llama-3's 128,000 regular ids. Either way ids are the same in every process and run.

``render_chat`` renders chat messages through a Llama-3-style template before tokenizing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from hashlib import blake2b
from pathlib import Path

VOCAB_SIZE = 128_256
REGULAR_VOCAB_SIZE = 128_000
MAX_LETTERS_PER_TOKEN = 7

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS: Mapping[str, int] = {
    BEGIN_OF_TEXT: 128000,
    END_OF_TEXT: 128001,
    START_HEADER: 128006,
    END_HEADER: 128007,
    EOT: 128009,
}
BOS_ID = SPECIAL_TOKENS[BEGIN_OF_TEXT]

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(token) for token in SPECIAL_TOKENS) + ")")
_PIECE_RE = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?(?:[^\w\s]|_)+|\s*[\r\n]+|\s+(?!\S)|\s+")


_TOKENIZER_JSON = Path(__file__).resolve().parent / "model_files" / "tokenizer.json"


def _load_vocab() -> dict[str, int]:
    try:
        with _TOKENIZER_JSON.open(encoding="utf-8") as handle:
            vocab = json.load(handle)["model"]["vocab"]
    except FileNotFoundError:  # while simulator.model_folder writes it for the first time
        return {}
    vocab.pop("[UNK]", None)
    for special in (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ):
        vocab.pop(special, None)  # never a piece: split out before pieces are cut
    return vocab


_VOCAB: dict[str, int] = _load_vocab()


@lru_cache(maxsize=1 << 16)
def token_id(piece: str) -> int:
    """The stable id of one text piece: its id in the emulated vocabulary, else a hash."""
    known = _VOCAB.get(piece)
    if known is not None:
        return known
    digest = blake2b(piece.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % REGULAR_VOCAB_SIZE


def split_pieces(text: str) -> list[str]:
    """The text pieces of plain text (no special-token handling), one per token."""
    pieces: list[str] = []
    append = pieces.append
    for piece in _PIECE_RE.findall(text):
        letters = len(piece) - (piece[0] == " ")
        if letters > MAX_LETTERS_PER_TOKEN and piece.lstrip(" ").isalpha():
            # A leading space stays on the first chunk, as byte-pair vocabularies do.
            first = MAX_LETTERS_PER_TOKEN + (piece[0] == " ")
            append(piece[:first])
            for start in range(first, len(piece), MAX_LETTERS_PER_TOKEN):
                append(piece[start : start + MAX_LETTERS_PER_TOKEN])
        else:
            append(piece)
    return pieces


# Segments repeat a lot (a shared system prompt is re-sent with every request), so the ids of
# recent segments are kept; 512 segments of up to ~32k tokens bounds the memory.
@lru_cache(maxsize=512)
def _segment_ids(segment: str) -> tuple[int, ...]:
    return tuple(token_id(piece) for piece in split_pieces(segment))


def clear_caches() -> None:
    """Forget the memoised piece and segment ids (``Fleet.reset``: a run after another must not
    tokenize faster than the first did because the same prompts were seen before)."""
    token_id.cache_clear()
    _segment_ids.cache_clear()


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``; special tokens written literally become their single ids."""
    ids: list[int] = []
    for i, segment in enumerate(_SPECIAL_RE.split(text)):
        if not segment:
            continue
        if i % 2:  # re.split puts the captured special tokens at odd positions
            ids.append(SPECIAL_TOKENS[segment])
        else:
            ids.extend(_segment_ids(segment))
    return ids


def count_tokens(text: str) -> int:
    return len(tokenize(text))


def render_chat(messages: Iterable[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
    """Render ``{"role", "content"}`` messages with a Llama-3-style chat template.

    Like Llama-3's template, each message is ``<|start_header_id|>role<|end_header_id|>\\n\\n``
    + the stripped content + ``<|eot_id|>``, after one ``<|begin_of_text|>``; the generation
    prompt opens an assistant header. (Llama-3.1's date preamble is left out.)
    """
    parts = [BEGIN_OF_TEXT]
    for message in messages:
        parts.append(f"{START_HEADER}{message['role']}{END_HEADER}\n\n{message['content'].strip()}{EOT}")
    if add_generation_prompt:
        parts.append(f"{START_HEADER}assistant{END_HEADER}\n\n")
    return "".join(parts)


def tokenize_completion_prompt(prompt: str) -> list[int]:
    """A completions prompt gets a leading ``<|begin_of_text|>``, as vLLM's Llama tokenizer adds one."""
    return [BOS_ID, *tokenize(prompt)]
