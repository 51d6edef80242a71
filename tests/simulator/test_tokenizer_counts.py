"""The approximate tokenizer: stable ids, plausible English counts, Llama-3 chat template."""

from __future__ import annotations

import os
import random
import subprocess
import sys

from simulator.text import answer_pieces, text_of_tokens
from simulator.tokenizer import BOS_ID, SPECIAL_TOKENS, count_tokens, render_chat, split_pieces, tokenize
from tests.conftest import ROOT

PROSE = (
    "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his "
    "chin nuzzled into his breast in an effort to escape the vile wind, slipped quickly through the "
    "glass doors of Victory Mansions, though not quickly enough to prevent a swirl of gritty dust "
    "from entering along with him. You are a helpful customer support assistant for an online "
    "store. Answer questions about orders, shipping, returns and refunds politely and concisely."
)


def test_it_gives_about_one_point_three_tokens_per_english_word() -> None:
    ratio = count_tokens(PROSE) / len(PROSE.split())
    assert 1.1 <= ratio <= 1.5


def test_it_gives_the_same_ids_in_every_process() -> None:
    text = "Stable ids, please: 12345 tokens!"
    code = f"from simulator.tokenizer import tokenize; print(tokenize({text!r}))"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {str(tokenize(text))}


def test_it_splits_words_punctuation_and_long_words() -> None:
    assert split_pieces("Hello, world!") == ["Hello", ",", " world", "!"]
    assert split_pieces(" internationalization") == [" interna", "tionali", "zation"]
    assert split_pieces("2024") == ["202", "4"]


def test_it_renders_chat_through_a_llama3_template_with_single_special_tokens() -> None:
    rendered = render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}])
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tokenize(rendered)
    assert ids[0] == BOS_ID
    assert ids.count(SPECIAL_TOKENS["<|eot_id|>"]) == 2
    assert all(0 <= i < 128_256 for i in ids)


def test_it_sizes_generated_text_exactly_in_tokens() -> None:
    for n in (1, 17, 2048):
        assert count_tokens(text_of_tokens(random.Random(n), n)) == n
    pieces = [next(iter_) for iter_ in [answer_pieces(3)] for _ in range(50)]
    assert count_tokens("".join(pieces)) == 50
