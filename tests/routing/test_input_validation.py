"""Hostile or careless request bodies: every one a 400 with ``param``, never a 5xx.

Repros of issue 12: non-UTF-8 bytes inside a JSON string (content, model) and JSON nested ~1,000
deep gave 500; a made-up role and ``temperature: 5`` were accepted.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routing.cache.prompt import BodyError, parse_body
from tests.routing.support import MODEL, gateway_config, make_node, make_snapshot, publish, running_gateway

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": USER, **fields}).encode()


BAD_BODIES = [
    # (body, param) -- the first three are the 500 repros of issue 12
    (b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe bad"}]}', "messages[0].content"),
    (b'{"model":"\xff\xfe bad","messages":[{"role":"user","content":"x"}]}', "model"),
    (
        b'{"model":"m","messages":[{"role":"user","content":"x"}],"extra":'
        + b"[" * 1000
        + b"]" * 1000
        + b"}",
        None,
    ),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (chat(temperature=5), "temperature"),
    (chat(temperature=-0.1), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(top_p=1.5), "top_p"),
    (chat(n=0), "n"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens="many"), "max_tokens"),
    (chat(stop=3), "stop"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
]


class TestInputValidation:
    @pytest.mark.parametrize(("body", "param"), BAD_BODIES)
    def test_it_refuses_bad_bodies_naming_the_field(self, body, param):
        with pytest.raises(BodyError) as caught:
            parse_body("chat", body)
        assert caught.value.param == param

    def test_it_passes_valid_sampling_fields_and_unknown_fields(self):
        body = chat(
            temperature=2,
            top_p=1,
            n=2,
            max_tokens=5,
            stop=["\n"],
            stream=True,
            stream_options={"include_usage": True},
            logit_bias={"1": 2},
            guided_json={"type": "object"},
        )
        assert parse_body("chat", body).max_tokens == 5
        assert parse_body("completions", json.dumps({"model": "m", "prompt": "x", "top_p": 0.5}).encode())

    async def test_the_gateway_answers_400_never_500(self, aredis, redis_keys, redis_url, stubs):
        await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            answers = []
            for body, _ in BAD_BODIES:
                body = body.replace(b'"m"', json.dumps(MODEL).encode(), 1)
                response = await gateway.http.post("/v1/chat/completions", content=body)
                answers.append((response.status_code, response.json()["error"]["param"]))
        assert answers == [(400, param) for _, param in BAD_BODIES]
        assert stubs[0].seen == []


# ---- fuzzing: mutate valid bodies, parse, expect a result or a BodyError and nothing else ------

_VALID = [
    chat(stream=True, temperature=0.7, max_tokens=16),
    json.dumps({"model": "m", "prompt": [1, 2, [3, 4]], "n": 1}).encode(),
    json.dumps({"model": "m", "prompt": "hello", "stop": ["x"]}).encode(),
]


def _mutate(body: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    data = bytearray(body)
    for position, kind, payload in edits:
        at = position % (len(data) + 1)
        if kind == 0:
            data[at:at] = payload
        elif kind == 1:
            del data[at : at + len(payload)]
        else:
            data[at : at + len(payload)] = payload
    return bytes(data)


class TestParserFuzz:
    @settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(
        base=st.sampled_from(_VALID),
        edits=st.lists(
            st.tuples(st.integers(0, 400), st.integers(0, 2), st.binary(min_size=1, max_size=6)), max_size=4
        ),
        endpoint=st.sampled_from(["chat", "completions"]),
    )
    def test_it_never_raises_anything_but_body_error(self, base, edits, endpoint):
        try:
            parsed = parse_body(endpoint, _mutate(base, edits))
        except BodyError:
            return
        parsed.prompt_tokens_est(4.0)  # what the gateway does next must not fail either
        parsed.prompt_text.encode()

    @settings(max_examples=500, deadline=None, database=None)
    @given(
        document=st.recursive(
            st.none() | st.booleans() | st.floats() | st.text(),
            lambda c: st.lists(c) | st.dictionaries(st.text(), c),
            max_leaves=30,
        )
    )
    def test_it_never_fails_on_arbitrary_json(self, document):
        for endpoint in ("chat", "completions"):
            try:
                parse_body(endpoint, json.dumps(document).encode())
            except BodyError:
                pass


class TestDiscoveryEndpoints:
    async def test_health_and_model_retrieval_answer_like_vllm(self, aredis, redis_keys, redis_url, stubs):
        await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            health = await gateway.http.get("/health")
            model = await gateway.http.get(f"/v1/models/{MODEL}")
            missing = await gateway.http.get("/v1/models/no-such-model")
            wrong_method = await gateway.http.post("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert model.status_code == 200 and model.json()["id"] == MODEL and model.json()["object"] == "model"
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        assert wrong_method.status_code == 405
