"""Issue 26, item 7: a model configured by its folder (tokenizer.json, tokenizer_config.json with
its chat template, config.json), and its kv_block_size used before the node's first event."""

from __future__ import annotations

import json
import random
import shutil
from array import array
from pathlib import Path

from routing.cache.approx_index import ApproxPrefixIndex
from routing.cache.kv_aware_index import KVAwareIndex
from routing.cache.model_folder import read_max_model_len, tokenizer_files
from routing.cache.precise_index import PreciseIndex
from routing.cache.tokenization import ModelTokenizer
from routing.contract import ModelSpec, TokenizerSpec
from simulator.model_folder import CHAT_TEMPLATE_PATH, MODEL_FILES_DIR, TOKENIZER_PATH
from simulator.text import text_of_tokens


def hf_folder(tmp_path: Path) -> Path:
    """A folder as Hugging Face ships one: the template only inside tokenizer_config.json."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_FILES_DIR / name, folder / name)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return folder


def test_the_tokenizer_and_chat_template_come_from_the_folder(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path)
    files = tokenizer_files(ModelSpec("m", 32, 4096, model_folder=str(folder)))
    assert files == (str(folder / "tokenizer.json"), str(folder))
    from_folder = ModelTokenizer(*files)
    from_paths = ModelTokenizer(str(TOKENIZER_PATH), str(CHAT_TEMPLATE_PATH))
    body = json.dumps(
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]}
    ).encode()
    ids = from_folder.prompt_ids("chat", body)
    assert ids is not None and ids.ids == from_paths.prompt_ids("chat", body).ids
    assert read_max_model_len(folder) == 4096


def test_explicit_paths_win_and_the_folder_fills_the_template() -> None:
    spec = ModelSpec("m", 16, 8192, tokenizer=TokenizerSpec("/t/tokenizer.json"), model_folder="/models/m")
    assert tokenizer_files(spec) == ("/t/tokenizer.json", "/models/m")
    assert tokenizer_files(ModelSpec("m", 16, 8192)) is None


class _Subscriber:
    def mode(self, now_s: float) -> str:
        return "precise"


class _Events:
    """KVEvents as when nodes 1-8 each have a subscriber whose events are current (precise)."""

    def __init__(self) -> None:
        self.index = PreciseIndex()
        self.subscribers: dict = {node_id: _Subscriber() for node_id in range(1, 9)}

    def mode(self, node_id: int, now_s: float | None = None) -> str:
        return "precise"


def test_the_models_block_size_is_used_before_the_first_event() -> None:
    # No event yet (replay said: empty). A prompt just sent there counts as in flight, in the
    # node's real blocks of 32: a prompt of 3.5 blocks holds 3 of them, 96 tokens, not 7 x 16.
    index = KVAwareIndex(ApproxPrefixIndex(), _Events())  # type: ignore[arg-type]
    index.set_block_sizes({1: 32})
    rng = random.Random(7)
    prompt = array("I", [rng.randrange(1000) for _ in range(32 * 3 + 16 + 1)])
    text = text_of_tokens(rng, 20)
    assert index.match([1], text, prompt) == {}
    index.insert(1, text)
    assert index.match([1], text, prompt) == {1: 96}
