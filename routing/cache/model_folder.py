"""A model configured by its folder, as vLLM loads it: ``tokenizer.json``, ``tokenizer_config.json``
(with the chat template) and ``config.json``.

The gateway needs the tokenizer and the chat template for precise matching
(``routing.cache.tokenization``). A Hugging Face folder keeps the template in
``tokenizer_config.json`` (``"chat_template"``: a string, or a list of named templates of which
"default" is used), some ship it as ``chat_template.jinja`` beside it; the config comes first, as in
transformers. ``config.json``'s ``max_position_embeddings`` is what vLLM takes as ``max_model_len``
when it is not given.
"""

from __future__ import annotations

import json
from pathlib import Path

from routing.contract import ModelSpec

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "config.json"


def read_chat_template(folder: Path) -> str:
    """A model folder's chat template: ``tokenizer_config.json``'s ``chat_template`` (a string,
    or the one named "default" in a list of named templates), else ``chat_template.jinja``."""
    config_path = folder / TOKENIZER_CONFIG_FILE
    if config_path.is_file():
        template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, list):
            named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            return template
    jinja = folder / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    raise FileNotFoundError(f"{folder} has no chat template (tokenizer_config.json or chat_template.jinja)")


def read_chat_template_source(path: str) -> str:
    """The template a path names: a model folder, a ``tokenizer_config.json`` or a ``.jinja`` file."""
    location = Path(path)
    if location.is_dir():
        return read_chat_template(location)
    if location.name == TOKENIZER_CONFIG_FILE:
        return read_chat_template(location.parent)
    return location.read_text(encoding="utf-8")


def read_max_model_len(folder: Path) -> int | None:
    """``config.json``'s ``max_position_embeddings`` (vLLM's default ``max_model_len``), if any."""
    try:
        value = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def tokenizer_files(model: ModelSpec) -> tuple[str, str | None] | None:
    """(tokenizer.json, chat template path or folder) of a model, None when it names neither.

    Explicit paths (``ModelSpec.tokenizer``) win; a model folder gives what they leave out.
    """
    folder = model.model_folder
    if model.tokenizer is not None:
        return model.tokenizer.tokenizer_path, model.tokenizer.chat_template_path or folder
    if folder:
        return str(Path(folder) / TOKENIZER_FILE), folder
    return None
