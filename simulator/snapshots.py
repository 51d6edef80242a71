"""Policy snapshots as the control plane compiles them, for everything that stands in for it.

Tests and benchmarks publish snapshots without a control plane: they build them here, and write
them through the one snapshot writer (``routing.writer.write``). A field the contract gains is then
filled in one place, with the same defaults for every stand-in; each caller overrides only what
its scenario is about (its fleet, its algorithm, its block size).
"""

from __future__ import annotations

import time

from routing.contract import (
    SCHEMA_VERSION,
    AlgorithmParams,
    KVEventsSpec,
    ModelSpec,
    NodeSpec,
    PolicySnapshot,
    PolicySpec,
    RegionSpec,
    ResidencyRule,
    RoundRobinParams,
    TrialSpec,
    algorithm_name,
    encode_trial,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REGIONS = (
    RegionSpec("us-east", "US East", 39.0, -77.5),
    RegionSpec("eu-central", "EU Central", 50.1, 8.7),
    RegionSpec("ap-south", "AP South", 19.1, 72.9),
)


def make_node(
    node_id: int,
    base_url: str = "http://127.0.0.1:9",
    *,
    region: str = "us-east",
    models: tuple[str, ...] = (MODEL,),
    state: str = "active",
    name: str | None = None,
    gpu_type: str = "H100",
    gpu_count: int = 1,
    max_num_seqs: int = 256,
    prefill_tokens_per_s: float = 10_000.0,
    kv_capacity_tokens: int = 500_000,
    kv_events: KVEventsSpec | None = None,
) -> NodeSpec:
    """One node of the snapshot (``node-<id>`` in ``us-east`` serving ``MODEL`` unless told)."""
    return NodeSpec(
        id=node_id,
        name=name or f"node-{node_id}",
        region=region,
        base_url=base_url,
        models=models,
        gpu_type=gpu_type,
        gpu_count=gpu_count,
        max_num_seqs=max_num_seqs,
        prefill_tokens_per_s=prefill_tokens_per_s,
        kv_capacity_tokens=kv_capacity_tokens,
        state=state,  # type: ignore[arg-type]
        kv_events=kv_events,
    )


def make_snapshot(
    nodes: tuple[NodeSpec, ...],
    *,
    version: int = 1,
    params: AlgorithmParams | None = None,
    residency: tuple[ResidencyRule, ...] = (),
    model_scope: tuple[str, ...] = (),
    max_rtt_ms: float | None = None,
    schema_version: int = SCHEMA_VERSION,
    regions: tuple[RegionSpec, ...] = REGIONS,
    models: tuple[ModelSpec, ...] | None = None,
    name: str = "test-policy",
    checksum: str | None = None,
    shadow: TrialSpec | None = None,
    canary: TrialSpec | None = None,
) -> PolicySnapshot:
    """A compiled snapshot of ``nodes`` under one policy (round robin unless ``params`` say otherwise).

    ``models`` defaults to every model the nodes serve, 16-token blocks and 8192 tokens of context;
    ``checksum`` to one that names the version and the algorithm. ``shadow`` and ``canary``:
    trials beside the policy (issue 23), compiled in as the control plane does.
    """
    params = params if params is not None else RoundRobinParams()
    algorithm = algorithm_name(type(params))
    if models is None:
        served = sorted({model for node in nodes for model in node.models})
        models = tuple(ModelSpec(name=m, kv_block_size=16, max_context_tokens=8192) for m in served)
    return PolicySnapshot(
        schema_version=schema_version,
        version=version,
        checksum=checksum or f"sha-{version}-{algorithm}",
        published_at=time.time(),
        policy=PolicySpec(
            id=1,
            name=name,
            algorithm=algorithm,  # type: ignore[arg-type]
            params=params,
            model_scope=model_scope,
            residency=residency,
            max_rtt_ms=max_rtt_ms,
        ),
        regions=regions,
        models=models,
        nodes=nodes,
        **{kind: encode_trial(trial) for kind, trial in (("shadow", shadow), ("canary", canary)) if trial},
    )
