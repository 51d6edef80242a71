"""Issue 26, item 8: long prompts stay precise. A text that begins as an already tokenized one
reuses its ids up to a safe boundary and tokenizes only the rest; the ids are exactly the
tokenizer's (here against the tokenizer itself; against vLLM's /tokenize in tests/e2e)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from routing.cache.tokenization import CHECKPOINT_CHARS, DEFAULT_COLD_BUDGET_CHARS, ModelTokenizer
from simulator.model_folder import TOKENIZER_PATH
from simulator.text import text_of_tokens

# Llama 3's pre-tokenizer pattern (tokenizer.json of Meta-Llama-3), over byte-level BPE.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def document(seed: int, chars: int) -> str:
    """Prose, code and odd whitespace: lines of words, indented code, blank lines, accents."""
    rng = random.Random(seed)
    lines: list[str] = []
    while sum(len(line) + 1 for line in lines) < chars:
        kind = rng.random()
        if kind < 0.6:
            lines.append(text_of_tokens(rng, rng.randrange(3, 40)))
        elif kind < 0.8:
            lines.append(
                "    " * rng.randrange(3) + f"x_{rng.randrange(99)} = f({rng.randrange(1000)}) + 'é'"
            )
        elif kind < 0.9:
            lines.append("")
        else:
            lines.append(rng.choice(["  ", "\t- item", "## Title", "1. First", "naïve café — déjà vu"]))
    return "\n".join(lines)[:chars]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([document(seed, 4000) for seed in range(30)], trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("which", ["byte-level BPE", "emulated model"])
def test_a_growing_conversation_reuses_its_ids_and_they_stay_exact(which: str, bpe_path: Path) -> None:
    path = str(bpe_path) if which == "byte-level BPE" else str(TOKENIZER_PATH)
    tokenizer = ModelTokenizer(path, None)
    reference = Tokenizer.from_file(path)
    assert tokenizer._prefix_reuse
    text = document(1, 3000)
    assert tokenizer.text_ids(text).complete
    for turn in range(12):
        # Each turn repeats everything before it and adds what, with the checkpoint it falls back
        # to, stays under the inline budget, cut at any character (mid-word too): one segment,
        # new at every turn, as with a template that puts no special token between messages.
        added = random.Random(turn).randrange(200, DEFAULT_COLD_BUDGET_CHARS - CHECKPOINT_CHARS - 600)
        text = text + document(100 + turn, added)
        before = tokenizer.reused_chars
        ids = tokenizer.text_ids(text)
        assert ids.complete, f"turn {turn}: {len(text)} chars"
        assert list(ids.ids) == reference.encode(text, add_special_tokens=False).ids
        assert tokenizer.reused_chars - before >= len(text) - DEFAULT_COLD_BUDGET_CHARS
    assert len(text) > 4 * DEFAULT_COLD_BUDGET_CHARS  # beyond what one request may tokenize


def test_any_cut_of_a_known_text_gives_the_tokenizers_ids(bpe_path: Path) -> None:
    tokenizer = ModelTokenizer(str(bpe_path), None, cold_budget_chars=10**9)
    reference = Tokenizer.from_file(str(bpe_path))
    base = document(7, 20_000)
    tokenizer.text_ids(base)
    rng = random.Random(3)
    for _ in range(40):
        cut = rng.randrange(len(base))
        text = base[:cut] + document(rng.randrange(10**6), rng.randrange(1, 500))
        assert list(tokenizer.text_ids(text).ids) == reference.encode(text, add_special_tokens=False).ids


def test_a_tokenizer_whose_pieces_cross_line_breaks_reuses_nothing(tmp_path: Path) -> None:
    # Pieces split on spaces only keep "end\nThe" whole: a line break is no safe boundary there.
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^ ]+"), behavior="isolated", invert=True)
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"], show_progress=False)
    tokenizer.train_from_iterator([document(seed, 2000) for seed in range(5)], trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    model = ModelTokenizer(str(path), None, cold_budget_chars=10**9)
    assert not model._prefix_reuse
    text = document(1, 5000)
    model.text_ids(text)
    longer = text + "\nMore words"
    assert list(model.text_ids(longer).ids) == Tokenizer.from_file(str(path)).encode(longer).ids
    assert model.reused_chars == 0
