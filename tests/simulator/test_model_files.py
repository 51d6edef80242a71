"""The emulated model's tokenizer.json and chat template give the engine's own token ids."""

from __future__ import annotations

import random

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from simulator.model_files import CHAT_TEMPLATE, CHAT_TEMPLATE_PATH, TOKENIZER_PATH, build_tokenizer_json
from simulator.text import text_of_tokens
from simulator.tokenizer import render_chat, tokenize, tokenize_completion_prompt
from simulator.traffic.workloads import build_plan


def test_the_shipped_files_are_the_built_ones() -> None:
    assert TOKENIZER_PATH.read_text(encoding="utf-8") == build_tokenizer_json()
    assert CHAT_TEMPLATE_PATH.read_text(encoding="utf-8") == CHAT_TEMPLATE


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
