"""A model's prompt as token ids at the gateway: its chat template, then its tokenizer.

Precise prefix matching (``routing.cache.kv_aware_index``) compares the prompt's blocks with the blocks the
node reported in its KV events, so it needs the token ids the engine computes: the chat template
applied (vLLM's ``apply_chat_template``), then the tokenizer without added special tokens; for
completions, the tokenizer with them (Llama's ``<|begin_of_text|>``). Each model in the snapshot may
name a Hugging Face ``tokenizer.json`` and a Jinja chat template by path (``ModelSpec.tokenizer``);
the emulated fleet ships both files (``simulator/model_files/``), so emulated and real models run
the same code. A model without them is routed on the approximate index.

Cost. A Hugging Face tokenizer needs ~1 µs per token (7 ms for 8k tokens), seven times the whole
routing budget. But the special tokens a chat template puts between messages are split out before
anything else, so the text between two of them tokenizes on its own: each such segment's ids are
cached (LRU, bounded in entries and tokens), and a request pays only for segments it is the first
to bring (a new user turn). A long segment that begins like one tokenized before (a conversation
rendered as one piece, one turn longer) reuses the ids of its longest checkpointed beginning, up to
a safe boundary, and tokenizes only the rest (``_checkpoints``). More than ``cold_budget_chars``
new characters are not tokenized on the request path: the ids stop before them (the match can
only be shorter: an under-estimate) and the segment is tokenized on a worker thread right after,
so the next request that carries it finds it cached.
"""

from __future__ import annotations

import asyncio
import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

from routing.cache.model_folder import read_chat_template_source
from routing.cache.precise_index import Tenant

logger = logging.getLogger("routing.tokenization")

DEFAULT_COLD_BUDGET_CHARS = 4096  # ~1k tokens, ~1 ms: new text a request may tokenize inline
CACHE_MAX_SEGMENTS = 4096
CACHE_MAX_TOKENS = 8_000_000  # ~32 MB of ids
# Long segments: every CHECKPOINT_CHARS characters, the ids up to a safe boundary before that
# point, found again by a digest of the text up to it (so a longer text that begins alike reuses
# them and tokenizes only the rest).
CHECKPOINT_CHARS = 1024
CHECKPOINTS_MAX = 65_536
# A safe boundary: just after a line break that a letter follows. A regex pre-tokenizer (GPT-2,
# Llama 3, the emulated model's) ends a piece there and scans no further to decide it, so the ids
# before it do not depend on what follows the letter.
_SAFE_BOUNDARY = re.compile(r"\n(?=[^\W\d_])")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|eot_id|>", "<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>")


class TokenizerError(ValueError):
    """A tokenizer or chat template file is missing or invalid."""


@dataclass(frozen=True, slots=True)
class PromptIds:
    """The prompt's token ids; ``complete`` is False when a long new segment was left out.

    ``tenant``: what vLLM hashes into the blocks besides the ids (``cache_salt``, the LoRA adapter),
    None when nothing: part of the prompt's block keys.
    """

    ids: array  # array("I")
    complete: bool
    tenant: Tenant | None = None


class _Part(msgspec.Struct):
    type: str = ""
    text: str | None = None


class _Message(msgspec.Struct):
    role: str = ""
    content: str | list[_Part] | None = None


class _ChatBody(msgspec.Struct):
    messages: list[_Message] = []
    cache_salt: str | None = None


class _CompletionBody(msgspec.Struct):
    prompt: str | list[str | int | list[int]] | None = None
    cache_salt: str | None = None


_chat_decoder = msgspec.json.Decoder(_ChatBody)
_completion_decoder = msgspec.json.Decoder(_CompletionBody)


class ModelTokenizer:
    """One model's tokenizer and chat template, with the segment cache."""

    def __init__(
        self,
        tokenizer_path: str,
        chat_template_path: str | None,
        *,
        cold_budget_chars: int = DEFAULT_COLD_BUDGET_CHARS,
        background: ThreadPoolExecutor | None = None,
    ) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self.tokenizer_path = tokenizer_path
        self.chat_template_path = chat_template_path
        try:
            self._tokenizer = Tokenizer.from_file(tokenizer_path)
        except Exception as exc:
            raise TokenizerError(f"cannot load tokenizer {tokenizer_path}: {exc}") from None
        self._template = None
        if chat_template_path:
            try:
                # A .jinja file, a tokenizer_config.json, or a model folder (its config first).
                source = read_chat_template_source(chat_template_path)
                # Hugging Face's settings for chat templates (transformers' apply_chat_template).
                environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                environment.globals["raise_exception"] = _raise
                self._template = environment.from_string(source)
            except (OSError, TemplateError) as exc:
                raise TokenizerError(f"cannot load chat template {chat_template_path}: {exc}") from None
        special = {
            token.content: token_id
            for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
            if token.special
        }
        self._special = special
        self._special_re = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(special, key=len, reverse=True)) + ")")
            if special
            else None
        )
        self._bos = next((name for name in _BOS_NAMES if name in special), "")
        self._eos = next((name for name in _EOS_NAMES if name in special), "")
        # What encoding with special tokens adds around a completions prompt (e.g. BOS).
        self._prefix_ids = array("I", self._tokenizer.encode("", add_special_tokens=True).ids)
        self._cold_budget = cold_budget_chars
        self._background = background
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._cache_tokens = 0
        self._queued: set[str] = set()
        self.cold_segments_deferred = 0
        # (chars up to the checkpoint, digest of them) -> (boundary char, ids before it, the ids)
        self._checkpoints: OrderedDict[tuple[int, int], tuple[int, int, array]] = OrderedDict()
        self._prefix_reuse = self._boundaries_are_safe()
        self.reused_chars = 0  # characters whose ids came from a checkpoint (for the benchmark)

    # ---- the request path ---------------------------------------------------------------------

    def prompt_ids(self, endpoint: str, body: bytes, lora_name: str | None = None) -> PromptIds | None:
        """The request's prompt ids, or None when they cannot be known (no template, odd input).

        ``lora_name``: the adapter the request's model names (vLLM hashes it into every block).
        """
        ids = self._prompt_ids(endpoint, body)
        if ids is None or (lora_name is None and ids.tenant is None):
            return ids
        salt = ids.tenant.cache_salt if ids.tenant is not None else None
        return PromptIds(ids.ids, ids.complete, Tenant(lora_name, salt))

    def _prompt_ids(self, endpoint: str, body: bytes) -> PromptIds | None:
        try:
            if endpoint == "chat":
                if self._template is None:
                    return None
                chat = _chat_decoder.decode(body)
                messages = [{"role": m.role, "content": _content_text(m.content)} for m in chat.messages]
                text = self._template.render(
                    messages=messages,
                    add_generation_prompt=True,
                    bos_token=self._bos,
                    eos_token=self._eos,
                )
                return _salted(self.text_ids(text), chat.cache_salt)
            completion = _completion_decoder.decode(body)
            prompt = completion.prompt
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = self.text_ids(prompt)
                return _salted(PromptIds(self._prefix_ids + ids.ids, ids.complete), completion.cache_salt)
            if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
                return _salted(PromptIds(array("I", prompt), True), completion.cache_salt)  # type: ignore[arg-type]
            return None
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
            return None
        except Exception as exc:  # a template's raise_exception, or a template bug
            logger.debug("cannot render the prompt for %s: %s", self.tokenizer_path, exc)
            return None

    def text_ids(self, text: str) -> PromptIds:
        """Ids of text that may contain special tokens (added tokens are split out first)."""
        parts = self._special_re.split(text) if self._special_re is not None else [text]
        ids = array("I")
        cold_chars = 0
        cache = self._cache
        for index, part in enumerate(parts):
            if not part:
                continue
            if index % 2:
                ids.append(self._special[part])
                continue
            cached = cache.get(part)
            if cached is not None:
                cache.move_to_end(part)
                ids.extend(cached)
                continue
            start, reused, known = self._longest_known_prefix(part)
            cold_chars += len(part) - start
            if cold_chars > self._cold_budget:
                self._defer(part)
                return PromptIds(ids, False)
            ids.extend(self._encode(part, start, reused, known))
        return PromptIds(ids, True)

    # ---- long segments: reuse the ids of the longest known beginning ---------------------------

    def _boundaries_are_safe(self) -> bool:
        """Whether this tokenizer's ids split at ``_SAFE_BOUNDARY`` (checked on probe texts)."""
        probes = (
            "Hello world.\nThe end",
            "a  b\n\nSecond  line,\nthird",
            "x = 1\n    return y\nz",
            "words\nwords and more words\nok",
        )
        encode = self._tokenizer.encode
        for text in probes:
            for match in _SAFE_BOUNDARY.finditer(text):
                cut = match.end()
                whole = encode(text, add_special_tokens=False).ids
                if (
                    whole
                    != encode(text[:cut], add_special_tokens=False).ids
                    + encode(text[cut:], add_special_tokens=False).ids
                ):
                    return False
        return True

    def _longest_known_prefix(self, part: str) -> tuple[int, int, array | None]:
        """(boundary char, ids before it, the ids holding them) of the longest checkpointed
        beginning of ``part``; (0, 0, None) when none."""
        if not self._prefix_reuse or len(part) < CHECKPOINT_CHARS:
            return 0, 0, None
        checkpoints = self._checkpoints
        for chars, digest in reversed(_digests(part)):
            found = checkpoints.get((chars, digest))
            if found is not None:
                checkpoints.move_to_end((chars, digest))
                return found
        return 0, 0, None

    def _encode(self, segment: str, start: int = 0, reused: int = 0, known: array | None = None) -> array:
        """The segment's ids: ``known[:reused]`` for ``segment[:start]``, the rest tokenized."""
        encoding = self._tokenizer.encode(segment[start:], add_special_tokens=False)
        encoded = array("I", known[:reused]) if known is not None else array("I")
        encoded.extend(encoding.ids)
        self.reused_chars += start
        self._remember(segment, encoded)
        if self._prefix_reuse and len(segment) >= CHECKPOINT_CHARS:
            self._add_checkpoints(_checkpoints(segment, start, reused, encoding.offsets), encoded)
        return encoded

    def _add_checkpoints(self, found: list[tuple[int, int, int, int]], encoded: array) -> None:
        checkpoints = self._checkpoints
        for chars, digest, boundary, count in found:
            checkpoints[(chars, digest)] = (boundary, count, encoded)
        while len(checkpoints) > CHECKPOINTS_MAX:
            checkpoints.popitem(last=False)

    def _remember(self, segment: str, encoded: array) -> None:
        cache = self._cache
        if segment in cache:
            return
        cache[segment] = encoded
        self._cache_tokens += len(encoded)
        while len(cache) > CACHE_MAX_SEGMENTS or self._cache_tokens > CACHE_MAX_TOKENS:
            _, dropped = cache.popitem(last=False)
            self._cache_tokens -= len(dropped)

    def _encode_elsewhere(
        self, segment: str, start: int, reused: int, known: array | None
    ) -> tuple[array, list[tuple[int, int, int, int]]]:
        """``_encode`` on the worker thread: computes, the loop's thread stores."""
        encoding = self._tokenizer.encode(segment[start:], add_special_tokens=False)
        encoded = array("I", known[:reused]) if known is not None else array("I")
        encoded.extend(encoding.ids)
        found = (
            _checkpoints(segment, start, reused, encoding.offsets)
            if self._prefix_reuse and len(segment) >= CHECKPOINT_CHARS
            else []
        )
        return encoded, found

    def _defer(self, segment: str) -> None:
        self.cold_segments_deferred += 1
        if self._background is None or segment in self._queued or len(self._queued) > 64:
            return
        self._queued.add(segment)
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        start, reused, known = self._longest_known_prefix(segment)
        future = self._background.submit(self._encode_elsewhere, segment, start, reused, known)

        def store(result: Any) -> None:
            self._queued.discard(segment)
            if not result.cancelled() and result.exception() is None:
                encoded, found = result.result()
                self._remember(segment, encoded)
                self._add_checkpoints(found, encoded)

        def done(result: Any) -> None:
            # The cache belongs to the event loop's thread: hand the result over to it.
            if loop is None:
                store(result)
            elif not loop.is_closed():
                loop.call_soon_threadsafe(store, result)

        future.add_done_callback(done)


def _salted(ids: PromptIds, cache_salt: str | None) -> PromptIds:
    # vLLM refuses an empty salt (400): such a request is never cached, its keys do not matter.
    return PromptIds(ids.ids, ids.complete, Tenant(None, cache_salt)) if cache_salt else ids


def _digests(text: str) -> list[tuple[int, int]]:
    """(chars, xxh3 of ``text[:chars]``) at every ``CHECKPOINT_CHARS`` characters, in one pass."""
    state = xxhash.xxh3_64()
    digests = []
    for end in range(CHECKPOINT_CHARS, len(text) + 1, CHECKPOINT_CHARS):
        state.update(text[end - CHECKPOINT_CHARS : end].encode("utf-8", "surrogatepass"))
        digests.append((end, state.intdigest()))
    return digests


def _checkpoints(
    segment: str, start: int, reused: int, offsets: list[tuple[int, int]]
) -> list[tuple[int, int, int, int]]:
    """(chars, digest, boundary, ids before it) for the checkpoints of ``segment`` past ``start``.

    ``offsets``: the character spans of the ids of ``segment[start:]``; a boundary counts only
    where an id ends exactly (a piece boundary), the last safe one before the checkpoint.
    """
    ends = {end + start: index + 1 for index, (_begin, end) in enumerate(offsets)}
    boundaries = [
        (match.end(), ends[match.end()])
        for match in _SAFE_BOUNDARY.finditer(segment, start)
        if match.end() in ends
    ]
    found: list[tuple[int, int, int, int]] = []
    position = 0
    latest: tuple[int, int] | None = None
    for chars, digest in _digests(segment):
        # The boundary's letter must lie inside the checkpointed text: boundary < chars.
        while position < len(boundaries) and boundaries[position][0] < chars:
            latest = boundaries[position]
            position += 1
        if latest is not None and latest[0] > start:
            found.append((chars, digest, latest[0], reused + latest[1]))
    return found


def _content_text(content: str | list[_Part] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content if part.text is not None)


def _raise(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


class Tokenizers:
    """Model name -> its ``ModelTokenizer``, following the snapshot; files loaded once per path."""

    def __init__(self, *, cold_budget_chars: int = DEFAULT_COLD_BUDGET_CHARS) -> None:
        self._by_model: dict[str, ModelTokenizer] = {}
        self._by_paths: dict[tuple[str, str | None], ModelTokenizer] = {}
        self._lora_adapters: frozenset[str] = frozenset()
        self._cold_budget = cold_budget_chars
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gorgo-tokenize")
        self.errors: dict[str, str] = {}  # model -> why its tokenizer could not be loaded

    def get(self, model: str) -> ModelTokenizer | None:
        return self._by_model.get(model)

    def prompt_ids(self, model: str, endpoint: str, body: bytes) -> PromptIds | None:
        """The request's prompt ids; None when the model has no (loadable) tokenizer."""
        tokenizer = self._by_model.get(model)
        if tokenizer is None:
            return None
        return tokenizer.prompt_ids(endpoint, body, model if model in self._lora_adapters else None)

    def sync(
        self,
        specs: Mapping[str, tuple[str, str | None]],
        lora_adapters: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """``specs``: model -> (tokenizer path, chat template path). Bad files are logged, skipped.

        ``lora_adapters``: the models whose name is a LoRA adapter's (keyed with it).
        """
        self._lora_adapters = frozenset(lora_adapters)
        by_paths: dict[tuple[str, str | None], ModelTokenizer] = {}
        by_model: dict[str, ModelTokenizer] = {}
        errors: dict[str, str] = {}
        for model, paths in specs.items():
            tokenizer = by_paths.get(paths) or self._by_paths.get(paths)
            if tokenizer is None:
                try:
                    tokenizer = ModelTokenizer(
                        paths[0], paths[1], cold_budget_chars=self._cold_budget, background=self._background
                    )
                except TokenizerError as exc:
                    logger.warning("model %s is routed on the approximate index: %s", model, exc)
                    errors[model] = str(exc)
                    continue
            by_paths[paths] = tokenizer
            by_model[model] = tokenizer
        self._by_paths = by_paths
        self._by_model = by_model
        self.errors = errors

    def close(self) -> None:
        self._background.shutdown(wait=False, cancel_futures=True)
