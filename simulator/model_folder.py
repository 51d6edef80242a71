"""The emulated model's folder (``simulator/model_files/``) in Hugging Face's formats, and how a
model folder's tokenizer and chat template are read.

A gateway that routes on KV events needs the prompt's token ids as the engine sees them, so it
loads each model's ``tokenizer.json`` (Hugging Face ``tokenizers``) and chat template (Jinja). A
real model folder, as vLLM loads one, keeps the chat template in ``tokenizer_config.json``
(``"chat_template"``); some ship it as ``chat_template.jinja`` beside it.
``read_chat_template(folder)`` reads either (the config first, as transformers does). For the
emulated fleet this module writes the folder's files (``python -m simulator.model_folder``):
``tokenizer.json``, ``tokenizer_config.json`` with the chat template, and the same template as
``chat_template.jinja``, so the gateway runs one code path for emulated and real models. The tiny
real model the tests serve with vLLM (``scripts/ensure_tiny_model.py``) copies these files.

``tokenizer.json`` reproduces ``simulator.tokenizer`` exactly on the emulated vocabulary: the same
pre-tokenizer (one regular expression: the piece pattern with letter runs cut every 7 letters),
Llama-3's special tokens with their ids, a ``<|begin_of_text|>`` post-processor, and a word-level
vocabulary of every piece the emulated model and the workloads produce (the words of
``simulator.text``, digits, punctuation, the template's role names, a few hundred common words).
The emulated engine takes those pieces' ids from this vocabulary (``simulator.tokenizer.token_id``)
and gives any other piece a hash id; the Hugging Face tokenizer gives such a piece ``[UNK]``, so on
text outside the vocabulary the gateway's block keys differ from the engine's and the precise index
under-estimates (never over-estimates) that node's cache.

The chat template is ``simulator.tokenizer.render_chat`` in Jinja, as a Hugging Face chat template.
"""

from __future__ import annotations

import json
import string
import sys
from hashlib import blake2b
from pathlib import Path

from routing.cache.model_folder import read_chat_template  # noqa: F401  (one reader, the gateway's)

MODEL_FILES_DIR = Path(__file__).resolve().parent / "model_files"
TOKENIZER_PATH = MODEL_FILES_DIR / "tokenizer.json"
CHAT_TEMPLATE_PATH = MODEL_FILES_DIR / "chat_template.jinja"
TOKENIZER_CONFIG_PATH = MODEL_FILES_DIR / "tokenizer_config.json"

# The same pieces as simulator.tokenizer's pattern, long letter runs cut every 7 letters.
PIECE_PATTERN = r" ?[^\W\d_]{1,7}| ?\d{1,3}| ?(?:[^\w\s]|_)+|\s*[\r\n]+|\s+(?!\S)|\s+"
UNK = "[UNK]"
UNK_ID = 128_255  # a reserved special id of Llama-3, never a regular piece

CHAT_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}\n"
    "{%- for message in messages -%}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "{%- endif -%}\n"
)

# Words a person trying the demo by hand is likely to type, beyond the emulated model's own.
_EXTRA_WORDS = """
    hello hi hey thanks thank please yes okay sure help question request tell explain write short
    story about what how who where why when which summary summarize list name names example code
    python test hello world system user assistant tool function developer follow manual below
    exactly briefly support number for travel booking billing retail returns medical insurance
    claims software licensing bank cards airline loyalty cloud scheduling
"""


def _vocabulary_pieces() -> list[str]:
    from simulator.text import WORDS
    from simulator.tokenizer import split_pieces

    words = set(WORDS) | set(_EXTRA_WORDS.split())
    text_parts: list[str] = []
    for word in sorted(words):
        for variant in (word, word.capitalize(), word.upper()):
            text_parts += [variant, " " + variant]
    pieces: set[str] = set()
    for part in text_parts:
        pieces.update(split_pieces(part))
    for number in range(1000):
        pieces.update((str(number), f" {number}", f"{number:02d}", f"{number:03d}"))
    for char in string.punctuation:
        pieces.update((char, " " + char))
    pieces.update((". ", "\n", "\n\n", " \n", " \n\n", " ", "  ", "   ", "    ", "\t"))
    pieces.update(string.ascii_letters)
    pieces.update(" " + c for c in string.ascii_letters)
    return sorted(pieces)


def build_vocab() -> dict[str, int]:
    """Piece -> id: the piece's stable hash id (as before files existed), probing past collisions."""
    from simulator.tokenizer import REGULAR_VOCAB_SIZE

    vocab: dict[str, int] = {}
    taken: set[int] = set()
    for piece in _vocabulary_pieces():
        digest = blake2b(piece.encode("utf-8"), digest_size=8).digest()
        token = int.from_bytes(digest, "little") % REGULAR_VOCAB_SIZE
        while token in taken:
            token = (token + 1) % REGULAR_VOCAB_SIZE
        taken.add(token)
        vocab[piece] = token
    vocab[UNK] = UNK_ID
    return vocab


def build_tokenizer_json() -> str:
    """The tokenizer.json text (deterministic)."""
    from simulator.tokenizer import BEGIN_OF_TEXT, SPECIAL_TOKENS

    added = [
        {
            "id": token_id,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for content, token_id in sorted(SPECIAL_TOKENS.items(), key=lambda item: item[1])
    ]
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": PIECE_PATTERN},
            "behavior": "Isolated",
            "invert": False,
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": BEGIN_OF_TEXT, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": BEGIN_OF_TEXT, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {
                BEGIN_OF_TEXT: {
                    "id": BEGIN_OF_TEXT,
                    "ids": [SPECIAL_TOKENS[BEGIN_OF_TEXT]],
                    "tokens": [BEGIN_OF_TEXT],
                }
            },
        },
        "decoder": {"type": "Fuse"},
        # The special tokens are in the model's vocabulary too: that is how they keep their ids.
        "model": {"type": "WordLevel", "vocab": {**build_vocab(), **SPECIAL_TOKENS}, "unk_token": UNK},
    }
    return json.dumps(document, ensure_ascii=False, indent=None, sort_keys=False) + "\n"


def build_tokenizer_config_json() -> str:
    """tokenizer_config.json as a real Llama-3 folder has it: special tokens and the chat template."""
    from simulator.tokenizer import BEGIN_OF_TEXT, END_OF_TEXT, EOT

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BEGIN_OF_TEXT,
        "eos_token": EOT,
        "pad_token": END_OF_TEXT,
        "unk_token": UNK,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    return json.dumps(config, ensure_ascii=False, indent=2) + "\n"


def write_files(directory: Path = MODEL_FILES_DIR) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TOKENIZER_PATH.name).write_text(build_tokenizer_json(), encoding="utf-8")
    (directory / TOKENIZER_CONFIG_PATH.name).write_text(build_tokenizer_config_json(), encoding="utf-8")
    (directory / CHAT_TEMPLATE_PATH.name).write_text(CHAT_TEMPLATE, encoding="utf-8")


if __name__ == "__main__":
    write_files(Path(sys.argv[1]) if len(sys.argv) > 1 else MODEL_FILES_DIR)
    print(f"wrote {TOKENIZER_PATH.name}, {TOKENIZER_CONFIG_PATH.name} and {CHAT_TEMPLATE_PATH.name}")
