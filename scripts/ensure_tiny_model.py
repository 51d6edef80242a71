#!/usr/bin/env python3
"""Build the tiny random-weight Llama that real vLLM serves in the tests, once, under var/.

Run it with the vLLM virtualenv's python (it needs torch and transformers; scripts/ensure_vllm.py
prints that python). Prints the model folder. Idempotent: a folder whose ``.built`` file names
this recipe's version is reused as is (milliseconds); building takes a few seconds.

The folder is a real Hugging Face model folder, as vLLM loads one: ``config.json``, weights
(``model.safetensors``), ``tokenizer.json`` and ``tokenizer_config.json`` WITH its
``chat_template`` (where real folders keep it), ``generation_config.json``. The tokenizer and chat
template are the emulated model's (``simulator/model_files/``), so real vLLM and the emulator
tokenize a prompt to the same ids and the conformance suite can compare them.

Shape: 2 layers, hidden 256, 4 heads of head_dim 64 (vLLM's CPU attention rejects head_dim 16),
vocab 128,256 (Llama-3's ids, which the emulated tokenizer uses). The weights are random (seed 0):
the model produces nonsense, which is all a routing test needs.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_FILES = ROOT / "simulator" / "model_files"
DEFAULT_FOLDER = ROOT / "var" / "tiny-llama"
RECIPE_VERSION = "2"  # bump when the recipe below changes, so cached folders are rebuilt

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 128_256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "bos_token_id": 128000,
    "eos_token_id": 128009,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def build(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    staging = folder.with_name(folder.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(staging, safe_serialization=True)
    # The emulated model's own folder files: tokenizer_config.json carries the chat template.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(MODEL_FILES / name, staging / name)
    (staging / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}) + "\n"
    )
    (staging / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 128000, "eos_token_id": [128001, 128009]}) + "\n"
    )
    (staging / ".built").write_text(RECIPE_VERSION + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)


def main() -> int:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_FOLDER
    built = folder / ".built"
    if not (built.is_file() and built.read_text().strip() == RECIPE_VERSION):
        build(folder)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
