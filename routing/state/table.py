"""The routing table: everything a request needs from (snapshot, live state), precomputed.

A ``RoutingTable`` is immutable and rebuilt whenever the snapshot or the live state changes; the
policy store swaps the reference atomically, so a request holds one consistent table from start to
finish and the request path does dictionary lookups only (no eligibility rules, no URL parsing,
no Redis).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from routing.algorithms.base import AlgorithmInfo
from routing.cache.prompt import DEFAULT_CHARS_PER_TOKEN
from routing.contract import AlgorithmParams, NodeLiveState, NodeSpec, PolicySnapshot, SessionAffinityParams
from routing.http.upstream import Target, make_target
from routing.state.eligibility import eligible_nodes, served_models
from routing.state.trials import TrialRoute, load_trial

DEFAULT_SESSION_HEADER = SessionAffinityParams().session_header
UPSTREAM_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class UnknownAlgorithm(ValueError):
    """The snapshot names an algorithm this gateway build does not have."""


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """One snapshot plus live state, digested for the request path.

    What a request reads is a ``dict`` (compiled, read with dict operations; a ``Mapping`` is read
    through Python's generic calls) or a field of its own (``version``, ``algorithm_name``,
    ``params``: the snapshot's msgspec structs are read through generic attribute lookups).
    """

    snapshot: PolicySnapshot
    region: str
    algorithm: AlgorithmInfo
    models: tuple[str, ...]  # served model names, sorted
    candidates: dict[str, tuple[NodeSpec, ...]]  # model -> eligible nodes, id order
    excluded: Mapping[str, Mapping[str, int]]  # model -> reason -> node count
    urls: dict[tuple[int, str], Target]  # (node id, path) -> upstream target (nodes with a usable URL)
    base_urls: dict[int, str]  # node id -> server root (for the gateway's own probes)
    rtt_ms: Mapping[int, float]  # node id -> RTT from this region (measured ones only)
    live: Mapping[int, NodeLiveState]
    chars_per_token: float
    session_header: str | None  # lower-case header the algorithm keys sessions on
    version_header: bytes
    models_body: bytes  # the GET /v1/models answer
    model_bodies: Mapping[str, bytes]  # model -> the GET /v1/models/{model} answer
    max_context_tokens: dict[str, int]  # model -> its context length (vLLM's max_model_len)
    version: int  # the snapshot's
    algorithm_name: str  # the live policy's (snapshot.policy.algorithm)
    params: AlgorithmParams  # the live policy's (snapshot.policy.params)
    shadow: TrialRoute | None = None  # decides beside the live policy, serves nothing (issue 23)
    canary: TrialRoute | None = None  # serves the sessions its hash picks (issue 23)
    uses_prefix_index: bool = False  # some policy here (live, shadow, canary) needs prefix matches
    # some policy here brings prefixes home (gorgo's ``homing_rent_ratio``): the view carries the
    # prompt's prefix and its rent (``routing.state.homing``)
    homes_prefixes: bool = False
    # the live policy routes on what the gateway measured (gorgo's ``measured_inputs``): its RTTs and
    # prefill speeds (``routing.state.measured``) go into the view in place of the told ones
    measures_inputs: bool = False


def node_base_url(base_url: str) -> str:
    """The server root of a node: tolerate base URLs given OpenAI-style with a trailing ``/v1``."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def build_table(
    snapshot: PolicySnapshot,
    region: str,
    registry: Mapping[str, AlgorithmInfo],
    live: Mapping[int, NodeLiveState],
    rtt_ms: Mapping[int, float],
) -> RoutingTable:
    """Digest a snapshot and live state; raise ``UnknownAlgorithm`` for an unregistered algorithm."""
    policy = snapshot.policy
    algorithm = registry.get(policy.algorithm)
    if algorithm is None:
        raise UnknownAlgorithm(
            f"policy {policy.name!r} v{snapshot.version} uses algorithm {policy.algorithm!r}, "
            f"which this gateway does not have (known: {', '.join(sorted(registry))})"
        )
    models = served_models(snapshot)
    candidates: dict[str, tuple[NodeSpec, ...]] = {}
    excluded: dict[str, dict[str, int]] = {}
    for model in models:
        candidates[model], excluded[model] = eligible_nodes(snapshot, model, region, live, rtt_ms)
    urls: dict[tuple[int, str], Target] = {}
    for node in snapshot.nodes:
        for path in UPSTREAM_PATHS:
            try:
                urls[(node.id, path)] = make_target(node_base_url(node.base_url) + path)
            except ValueError:
                pass  # not http(s): its requests get 502 (the control plane validates URLs)
    params = policy.params
    model_objects = [
        {"id": name, "object": "model", "created": int(snapshot.published_at), "owned_by": "gorgo"}
        for name in models
    ]
    models_body = msgspec.json.encode({"object": "list", "data": model_objects})
    shadow = load_trial(snapshot.shadow, snapshot, region, registry, live, rtt_ms)
    canary = load_trial(snapshot.canary, snapshot, region, registry, live, rtt_ms)
    session_header = getattr(params, "session_header", None)
    if canary is not None and not session_header:
        # The canary's arm follows a conversation by its session key: read one even when the live
        # policy keys nothing on it (the canary's own header, else the usual one).
        session_header = getattr(canary.params, "session_header", None) or DEFAULT_SESSION_HEADER
    return RoutingTable(
        snapshot=snapshot,
        region=region,
        algorithm=algorithm,
        models=models,
        candidates=candidates,
        excluded=excluded,
        urls=urls,
        base_urls={node.id: node_base_url(node.base_url) for node in snapshot.nodes},
        rtt_ms=dict(rtt_ms),
        live=dict(live),
        chars_per_token=getattr(params, "chars_per_token", DEFAULT_CHARS_PER_TOKEN),
        session_header=session_header.lower() if session_header else None,
        version_header=str(snapshot.version).encode(),
        models_body=models_body,
        model_bodies={str(entry["id"]): msgspec.json.encode(entry) for entry in model_objects},
        max_context_tokens={model.name: model.max_context_tokens for model in snapshot.models},
        version=snapshot.version,
        algorithm_name=policy.algorithm,
        params=params,
        shadow=shadow,
        canary=canary,
        uses_prefix_index=any(
            info.needs_prefix_matches
            for info in (algorithm, *(trial.algorithm for trial in (shadow, canary) if trial is not None))
        ),
        measures_inputs=bool(getattr(params, "measured_inputs", False)),
        homes_prefixes=any(
            getattr(each, "homing_rent_ratio", 0.0) > 0.0
            for each in (params, *(trial.params for trial in (shadow, canary) if trial is not None))
        ),
    )
