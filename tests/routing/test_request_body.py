"""Decoding the routing fields of a request body, and the prompt text prefix indexes match on."""

from __future__ import annotations

import json

import pytest

from routing.cache.prompt import BodyError, parse_body


def chat(messages, **extra) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


class TestRequestBody:
    def test_it_reads_model_stream_and_user(self):
        parsed = parse_body("chat", chat([{"role": "user", "content": "hi"}], stream=True, user="u1"))
        assert (parsed.model, parsed.stream, parsed.user) == ("m", True, "u1")

    def test_it_ignores_fields_it_does_not_route_by(self):
        body = chat([{"role": "user", "content": "hi", "name": "x"}], temperature=0.2, tools=[{"a": 1}])
        assert parse_body("chat", body).model == "m"

    def test_it_renders_chat_so_shared_history_is_a_shared_prefix(self):
        first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        longer = [*first, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
        short_text = parse_body("chat", chat(first)).prompt_text
        long_text = parse_body("chat", chat(longer)).prompt_text
        assert long_text.startswith(short_text)
        assert "system" in short_text and "Be brief." in short_text

    def test_it_reads_text_parts_of_multipart_content(self):
        content = [{"type": "text", "text": "look at "}, {"type": "image_url", "image_url": {"url": "x"}}]
        content.append({"type": "text", "text": "this"})
        assert "look at this" in parse_body("chat", chat([{"role": "user", "content": content}])).prompt_text

    def test_it_estimates_tokens_from_chars(self):
        parsed = parse_body("completions", json.dumps({"model": "m", "prompt": "x" * 400}).encode())
        assert parsed.prompt_chars == 400
        assert parsed.prompt_tokens_est(4.0) == 100
        assert parsed.prompt_tokens_est(2.0) == 200

    def test_it_counts_token_id_prompts_exactly(self):
        parsed = parse_body("completions", json.dumps({"model": "m", "prompt": [1, 2, 3, 4, 5]}).encode())
        assert parsed.prompt_tokens_est(4.0) == 5

    @pytest.mark.parametrize(
        ("endpoint", "body", "param"),
        [
            ("chat", b"{not json", None),
            ("chat", b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
            ("chat", b'{"model": "m"}', "messages"),
            ("chat", b'{"model": 3, "messages": []}', "model"),
            ("chat", b'{"model": "m", "messages": []}', "messages"),
            ("chat", b'{"model": "", "messages": [{"role": "user", "content": "x"}]}', "model"),
            ("completions", b'{"model": "m"}', "prompt"),
            ("completions", b'{"model": "m", "prompt": {"a": 1}}', "prompt"),
        ],
    )
    def test_it_explains_what_is_wrong(self, endpoint, body, param):
        with pytest.raises(BodyError) as caught:
            parse_body(endpoint, body)
        assert caught.value.param == param
        assert "Traceback" not in str(caught.value)
