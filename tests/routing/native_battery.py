"""Decisions and front-door verdicts over a seeded battery of inputs, printed as JSON.

Run twice by tests/routing/test_native.py, once over the compiled modules and once with
``GORGO_PURE_PYTHON=1``: the two outputs must be equal.
"""

from __future__ import annotations

import importlib
import json
import random
import sys

from routing import native
from routing.algorithms import REGISTRY
from routing.algorithms.base import NodeLoad, RoutingRequest, RoutingView
from routing.contract import (
    SCHEMA_VERSION,
    ClientKeySpec,
    GorgoParams,
    LeastLoadParams,
    NodeLiveState,
    PrefixAffinityParams,
    RedisKeys,
    RoundRobinParams,
    SessionAffinityParams,
)
from routing.frontdoor.auth import AuthError, authenticate, authorize, presented_secret
from routing.frontdoor.keystore import KeyStore, secret_hash
from simulator.snapshots import make_node

REGIONS = ("us-east", "eu-west", "ap-south")
PARAMS = (
    RoundRobinParams(),
    LeastLoadParams(),
    SessionAffinityParams(),
    PrefixAffinityParams(),
    PrefixAffinityParams(scope="local", cache_threshold=0.1),
    GorgoParams(),
    GorgoParams(w_rtt=0.2, w_queue=3.0, w_displacement=0.0),
)


def _terms(terms: object) -> object:
    return None if terms is None else [getattr(terms, field) for field in terms.__struct_fields__]


def decisions(rng: random.Random, views: int) -> list[object]:
    out: list[object] = []
    for case in range(views):
        count = rng.choice((1, 2, 3, 5, 16, 64))
        nodes = tuple(
            make_node(
                node_id,
                f"http://127.0.0.1:{9000 + node_id}",
                region=rng.choice(REGIONS),
                max_num_seqs=rng.choice((0, 1, 8, 256)),
                prefill_tokens_per_s=rng.choice((500.0, 10_000.0, 40_000.0)),
                kv_capacity_tokens=rng.choice((10_000, 500_000)),
            )
            for node_id in range(1, count + 1)
        )
        load = {
            node.id: NodeLoad(rng.randint(0, 300), rng.randint(0, 200_000))
            for node in nodes
            if rng.random() < 0.8
        }
        rtt_ms = {node.id: rng.uniform(0.1, 300.0) for node in nodes if rng.random() < 0.9}
        live = {
            node.id: NodeLiveState(
                SCHEMA_VERSION,
                node.id,
                True,
                1.7e9,
                num_running=rng.choice((None, 0.0, 12.0, 300.0)),
                num_waiting=rng.choice((None, 0.0, 5.0)),
                kv_cache_usage=rng.random(),
            )
            for node in nodes
            if rng.random() < 0.5
        }
        # Ties on purpose: equal prefixes and equal loads exercise the tie-spreading draws.
        matched = {node.id: rng.choice((0, 512, 4096, 4096)) for node in nodes if rng.random() < 0.4}
        prompt_chars = rng.choice((10, 4_000, 64_000))
        request = RoutingRequest(
            "m", prompt_chars, prompt_chars // 4, rng.choice((None, "s1", f"user-{case}"))
        )
        for params in PARAMS:
            view = RoutingView(
                rng.choice(REGIONS), nodes, params, load, rtt_ms, live, matched, case, f"gw-{case % 3}"
            )
            decision = REGISTRY[type(params).__struct_config__.tag].choose(view, request)
            out.append([decision.node.id, _terms(decision.cost), _terms(decision.runner_up)])
    return out


def verdicts() -> list[object]:
    keys = [
        ClientKeySpec(id="ok", secret_sha256=secret_hash("gorgo-sk-ok-1"), owner="a"),
        ClientKeySpec(
            id="scoped",
            secret_sha256=secret_hash("gorgo-sk-scoped-1"),
            owner="a",
            models=("m",),
            regions=("eu-west",),
        ),
        ClientKeySpec(id="gone", secret_sha256=secret_hash("gorgo-sk-gone-1"), owner="a", revoked=True),
        ClientKeySpec(id="old", secret_sha256=secret_hash("gorgo-sk-old-1"), owner="a", expires_at=100.0),
    ]
    store = KeyStore(None, RedisKeys(prefix="battery"))  # type: ignore[arg-type]  # no Redis: lookups only
    store.by_hash = {key.secret_sha256: key for key in keys}
    out: list[object] = []
    presented = [
        (None, None),
        (b"Bearer gorgo-sk-ok-1", None),
        (b"bearer   gorgo-sk-ok-1 ", None),
        (None, b"gorgo-sk-scoped-1"),
        (b"Bearer gorgo-sk-gone-1", None),
        (b"Bearer gorgo-sk-old-1", None),
        (b"Bearer nope", None),
        (b"Basic abc", None),
        (b"Bearer ", b""),
    ]
    for authorization, api_key in presented:
        secret = presented_secret(authorization, api_key)
        for model, region in (("m", "eu-west"), ("x", "eu-west"), ("m", "us-east")):
            try:
                key = authenticate(store, secret, 1_000.0)
                authorize(key, model, region)
                out.append(["ok", key.id])
            except AuthError as exc:
                out.append([exc.status, exc.reason, str(exc)])
    return out


def request_path(rng: random.Random, rounds: int) -> list[object]:
    """The compiled request path's pure parts: the header scans, in-flight views, log batches."""
    from routing.contract import RequestRecord
    from routing.errors import GatewayError
    from routing.http.headers import filter_response_headers, scan_request_headers
    from routing.http.upstream import encode_headers
    from routing.observability.request_log import _encode_batch
    from routing.state.inflight import InFlight

    names = [b"content-type", b"content-length", b"connection", b"keep-alive", b"x-request-id",
             b"authorization", b"api-key", b"x-session", b"accept-encoding", b"x-custom", b"te",
             b"date", b"server-timing", b"Content-Length", b"x-gorgo-node"]  # fmt: skip
    values = [b"12", b"close, x-custom", b"keep-alive", b"abc", b"Bearer k", b"gzip", b"", b"x" * 130, b"1e3"]
    out: list[object] = []
    for _ in range(rounds):
        raw = [(rng.choice(names), rng.choice(values)) for _ in range(rng.randrange(0, 8))]
        session = rng.choice([None, "x-session"])
        try:
            found = scan_request_headers(raw, session, keep_credentials=rng.random() < 0.5)
            out.append(
                [
                    [[n.decode(), v.decode()] for n, v in found.forward],
                    found.request_id,
                    found.content_length,
                    found.session_key,
                    encode_headers(found.forward).decode(),
                ]
            )
        except GatewayError as exc:
            out.append([exc.status, str(exc)])
        out.append([[n.decode(), v.decode()] for n, v in filter_response_headers(raw)])
    book = InFlight("eu-west")
    book.set_node_regions({1: "eu-west", 2: "us-east", 3: "eu-west"})
    leases = []
    for _ in range(rounds):
        step = rng.random()
        if step < 0.4:
            leases.append(
                book.begin(rng.randrange(1, 4), rng.randrange(0, 500), rng.choice([None, "us-east"]))
            )
        elif step < 0.6 and leases:
            rng.choice(leases).first_byte()
        elif step < 0.85 and leases:
            leases.pop(rng.randrange(len(leases))).release()
        else:
            peers = {
                n: NodeLoad(rng.randrange(0, 5), rng.randrange(0, 900), rng.randrange(0, 3))
                for n in (1, 3, 4)
            }
            book.set_peer_load({n: load for n, load in peers.items() if rng.random() < 0.7})
        out.append(sorted([n, repr(load)] for n, load in book.load_view().items()))
    records = [
        RequestRecord(
            schema_version=SCHEMA_VERSION,
            request_id=f"r{i}",
            ts=1.5 * i,
            gateway_region="eu-west",
            gateway_id="g",
            model="m",
            status=200,
            stream=False,
            error=rng.choice([None, 'é, "}{ 日本', "x" * rng.randrange(0, 300)]),
            prefix_hashes=tuple(rng.randrange(-(2**63), 2**63) for _ in range(rng.randrange(0, 40))),
        )
        for i in range(rounds)
    ]
    out.append(_encode_batch(records).hex())
    return out


def bodies(rng: random.Random, rounds: int) -> list[object]:
    """Request bodies through ``parse_body`` (compiled since issue 25's fifth round): what each
    parses to, or the client's error, for valid, invalid and mistyped fields."""
    from routing.cache.prompt import BodyError, parse_body

    contents: list[object] = [
        "hi",
        "",
        None,
        [{"type": "text", "text": "a"}, {"type": "image_url"}],
        "é\n",
        5,
    ]
    prompts: list[object] = ["p", ["a", "b"], [1, 2, 3], [[1, 2], [3]], "x" * 99, ["a", 1], [], None, 7]
    out: list[object] = []
    for _ in range(rounds):
        endpoint = rng.choice(["chat", "completions", "embeddings"])
        document: dict[str, object] = {"model": "m" if rng.random() < 0.9 else rng.choice(["", 3])}
        if endpoint == "chat":
            messages = [
                {"role": rng.choice(["user", "system", "user", "robot"]), "content": rng.choice(contents)}
                for _ in range(rng.randrange(0, 4))
            ]
            document["messages"] = messages
            if rng.random() < 0.3:
                document["max_completion_tokens"] = rng.choice([0, 9])
        elif endpoint == "completions":
            if rng.random() < 0.9:
                document["prompt"] = rng.choice(prompts)
        else:
            document["input"] = rng.choice(prompts)
        for field, values in (("stream", [True, False, "x"]), ("user", ["u", None]),
                              ("max_tokens", [1, 0]), ("temperature", [0.5, 3.0]),
                              ("stream_options", [{"include_usage": True}])):  # fmt: skip
            if rng.random() < 0.1:
                document[field] = rng.choice(values)
        body = json.dumps(document).encode() if rng.random() < 0.95 else b'{"model": "m", "messages": ['
        try:
            parsed = parse_body(endpoint, body)  # type: ignore[arg-type]
            out.append([repr(parsed), parsed.prompt_chars, parsed.prompt_tokens_est(3.5)])
        except BodyError as exc:
            out.append([str(exc), exc.param])
    return out


def main() -> None:
    rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 25)
    for name in native.MODULES:  # all of them, so ``loaded`` says where each came from
        importlib.import_module(name)
    out = {
        "decisions": decisions(rng, 150),
        "verdicts": verdicts(),
        "request_path": request_path(rng, 200),
        "bodies": bodies(rng, 300),
    }
    print(json.dumps({"loaded": native.loaded(), **out}))


if __name__ == "__main__":
    main()
