"""Gateway CPU per request to know a long prompt's token ids precisely (issue 26, item 8).

    python benchmarks/long_prompt_tokenize.py        # from the repo root; ~10 s, bounded

For prompts of 4k, 32k and 128k characters in ONE segment (a chat template with no special token
between messages renders the whole conversation as one piece, new at every turn), the thread CPU
time of ``ModelTokenizer.text_ids`` in three cases:

- ``cold``: a text never seen (everything tokenized; the gateway does this inline only up to
  ``DEFAULT_COLD_BUDGET_CHARS`` new characters, otherwise after the decision on its worker thread);
- ``next_turn``: the same conversation one turn later (~1,000 characters added at the end): the
  ids of the longest checkpointed beginning are reused, only the rest is tokenized;
- ``identical``: the same text again (the segment cache).

Two tokenizers: a byte-level BPE with Llama 3's pre-tokenizer (trained here, 8k vocabulary) and the
emulated model's word-level one (the tiny real model's). Every ``next_turn`` result is checked equal
to the tokenizer's own ids. Writes benchmarks/results/long_prompt_tokenize.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from routing.cache.tokenization import CHECKPOINT_CHARS, DEFAULT_COLD_BUDGET_CHARS, ModelTokenizer
from simulator.model_folder import TOKENIZER_PATH
from tests.routing.test_long_prompts import LLAMA3_PATTERN, document

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (4_000, 32_000, 128_000)
REPEATS = 7
TURN_CHARS = 1_000


def train_bpe(directory: Path) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([document(seed, 8000) for seed in range(60)], trainer)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def cpu_ms(call) -> float:
    start = time.thread_time()
    call()
    return (time.thread_time() - start) * 1000


def measure(path: str) -> dict[str, dict[str, float]]:
    reference = Tokenizer.from_file(path)
    results: dict[str, dict[str, float]] = {}
    for size in SIZES:
        cold, turn, same, tokens = [], [], [], 0
        for repeat in range(REPEATS):
            model = ModelTokenizer(path, None, cold_budget_chars=10**9)  # measure all, inline
            text = document(1000 * size + repeat, size - TURN_CHARS)
            cold.append(cpu_ms(lambda text=text, model=model: model.text_ids(text)))
            longer = text + document(7 + repeat, TURN_CHARS)
            turn.append(cpu_ms(lambda longer=longer, model=model: model.text_ids(longer)))
            same.append(cpu_ms(lambda longer=longer, model=model: model.text_ids(longer)))
            ids = model.text_ids(longer).ids
            assert list(ids) == reference.encode(longer, add_special_tokens=False).ids, "not exact"
            tokens = len(ids)
        results[f"{size // 1000}k"] = {
            "chars": size,
            "tokens": tokens,
            "cold_ms_median": round(statistics.median(cold), 3),
            "next_turn_ms_median": round(statistics.median(turn), 3),
            "identical_ms_median": round(statistics.median(same), 3),
        }
    return results


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()  # --help, and a clear error for anything else
    with tempfile.TemporaryDirectory() as directory:
        bpe = train_bpe(Path(directory))
        report = {
            "machine": {
                "python": platform.python_version(),
                "cpu": platform.processor() or platform.machine(),
            },
            "checkpoint_chars": CHECKPOINT_CHARS,
            "cold_budget_chars": DEFAULT_COLD_BUDGET_CHARS,
            "turn_chars": TURN_CHARS,
            "repeats": REPEATS,
            "tokenizers": {
                "byte-level BPE, Llama 3 pre-tokenizer, 8k vocab": measure(bpe),
                "emulated model (word-level, tiny-llama's)": measure(str(TOKENIZER_PATH)),
            },
        }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "long_prompt_tokenize.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Long prompts: gateway CPU per request to know their token ids (thread CPU, median)",
        "",
        f"One segment (no special token between messages); next turn adds {TURN_CHARS:,} characters; "
        f"checkpoints every {CHECKPOINT_CHARS:,} characters; inline budget "
        f"{DEFAULT_COLD_BUDGET_CHARS:,} new characters. Every result equals the tokenizer's own ids.",
        "",
    ]
    for name, rows in report["tokenizers"].items():
        lines += [
            f"## {name}",
            "",
            "| prompt | tokens | cold (all new) | next turn (reuse) | identical |",
            "|---|---|---|---|---|",
        ]
        for label, row in rows.items():
            lines.append(
                f"| {label} chars | {row['tokens']:,} | {row['cold_ms_median']} ms | "
                f"{row['next_turn_ms_median']} ms | {row['identical_ms_median']} ms |"
            )
        lines.append("")
    (RESULTS / "long_prompt_tokenize.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
