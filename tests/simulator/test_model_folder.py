"""The emulated model's tokenizer.json and chat template give the engine's own token ids."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from simulator.model_folder import (
    CHAT_TEMPLATE,
    CHAT_TEMPLATE_PATH,
    MODEL_FILES_DIR,
    TOKENIZER_CONFIG_PATH,
    TOKENIZER_PATH,
    build_tokenizer_config_json,
    build_tokenizer_json,
    read_chat_template,
)
from simulator.text import text_of_tokens
from simulator.tokenizer import render_chat, tokenize, tokenize_completion_prompt
from simulator.traffic.workloads import build_plan


def test_the_shipped_files_are_the_built_ones() -> None:
    assert TOKENIZER_PATH.read_text(encoding="utf-8") == build_tokenizer_json()
    assert TOKENIZER_CONFIG_PATH.read_text(encoding="utf-8") == build_tokenizer_config_json()
    assert CHAT_TEMPLATE_PATH.read_text(encoding="utf-8") == CHAT_TEMPLATE


def test_a_folder_keeps_its_chat_template_in_tokenizer_config_json_or_beside_it(tmp_path: Path) -> None:
    assert read_chat_template(MODEL_FILES_DIR) == CHAT_TEMPLATE
    only_config = tmp_path / "real"
    only_config.mkdir()
    (only_config / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
        )
    )
    assert read_chat_template(only_config) == "D"
    only_jinja = tmp_path / "jinja"
    only_jinja.mkdir()
    (only_jinja / "tokenizer_config.json").write_text("{}")
    (only_jinja / "chat_template.jinja").write_text("J")
    assert read_chat_template(only_jinja) == "J"
    with pytest.raises(FileNotFoundError):
        read_chat_template(tmp_path)


def test_hugging_face_tokenizers_reproduce_the_engines_ids_on_the_workloads() -> None:
    tokenizer = Tokenizer.from_file(str(TOKENIZER_PATH))
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    )
    plan = build_plan(
        "geo-chat", ["us-east", "eu-central"], rate_rps=5, duration_s=20, max_requests=50, seed=3
    )
    checked = 0
    for arrival in plan.arrivals[:20]:
        messages = (
            [{"role": "system", "content": plan.system_prompts[arrival.system_prompt]}]
            if arrival.system_prompt is not None
            else []
        )
        messages.append({"role": "user", "content": arrival.user_text})
        rendered = template.render(messages=messages, add_generation_prompt=True)
        assert rendered == render_chat(messages)
        assert tokenizer.encode(rendered, add_special_tokens=False).ids == tokenize(rendered)
        checked += 1
    assert checked
    prompt = "Request 12: " + text_of_tokens(random.Random(1), 300)
    assert tokenizer.encode(prompt).ids == tokenize_completion_prompt(prompt)
