"""Decoding the routing fields of a request body, and the prompt text prefix indexes match on."""

from __future__ import annotations

import json

import pytest

from routing.cache.prompt import BodyError, parse_body
from tests.routing.support import MODEL, gateway_config, make_node, make_snapshot, publish, running_gateway


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


class TestPromptPastTheContext:
    """Issue 22, item 5: a 3.9 MB prompt went to the node (which refused it) after the gateway had
    rendered and indexed all of it; the gateway now refuses it itself, with vLLM's 400."""

    async def test_a_prompt_past_the_models_context_is_refused_without_a_node(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))  # 8192 tokens
        too_long = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 30_000}]}
        fits = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 20_000}]}
        ids = {"model": MODEL, "prompt": [7] * 8193}
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            refused = await gateway.http.post("/v1/chat/completions", json=too_long)
            refused_ids = await gateway.http.post("/v1/completions", json=ids)
            served = await gateway.http.post("/v1/chat/completions", json=fits)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["type"] == "BadRequestError" and error["param"] == "messages"
        assert error["message"].startswith("This model's maximum context length is 8192 tokens.")
        assert (
            refused_ids.status_code == 400
            and "at least 8193 input tokens." in refused_ids.json()["error"]["message"]
        )
        # 100,000 characters may be 8,192 tokens or fewer: the node decides (and here serves it).
        assert served.status_code == 200
        assert len(stubs[0].seen) == 1
