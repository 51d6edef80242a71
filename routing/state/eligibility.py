"""Which nodes may serve a request: pure rules, no I/O.

A node is a candidate for a model when it serves the model (and the policy's ``model_scope``, when
non-empty, includes it), its state is ``active``, the live state does not mark it unhealthy (no
live entry yet counts as healthy: a fresh fleet must be routable before the first probe), it lies
in a region the policy's residency rule allows for this gateway's region, and its measured RTT from
this region is within ``max_rtt_ms`` (an unmeasured RTT does not exclude it).

The gateway evaluates these rules once per snapshot/live-state change (see ``routing.state.table``), not
per request.
"""

from __future__ import annotations

from collections.abc import Mapping

from routing.contract import NodeLiveState, NodeSpec, PolicySnapshot, PolicySpec, RTTTable

# Why a node is not a candidate (also shown, counted, in a 503's message).
NOT_SERVING = "does not serve the model"
OUT_OF_SCOPE = "model outside the policy scope"
UNHEALTHY = "unhealthy"
RESIDENCY = "residency rule"
RTT_TOO_HIGH = "rtt above max_rtt_ms"


def served_models(snapshot: PolicySnapshot) -> tuple[str, ...]:
    """Models this snapshot serves: the fleet's models, narrowed to the policy scope if it has one."""
    names = {model.name for model in snapshot.models}
    names.update(model for node in snapshot.nodes for model in node.models)
    scope = snapshot.policy.model_scope
    if scope:
        names &= set(scope)
    return tuple(sorted(names))


def allowed_node_regions(policy: PolicySpec, gateway_region: str) -> frozenset[str] | None:
    """Node regions a gateway in ``gateway_region`` may use; ``None`` means no restriction."""
    allowed: set[str] | None = None
    for rule in policy.residency:
        if rule.client_region == gateway_region:
            allowed = (allowed or set()) | set(rule.node_regions)
    return None if allowed is None else frozenset(allowed)


def rtt_from_region(table: RTTTable | None, region: str) -> dict[int, float]:
    """Node id -> measured RTT (ms) from ``region``."""
    if table is None:
        return {}
    return {entry.node_id: entry.rtt_ms for entry in table.entries if entry.region == region}


def exclusion_reason(
    node: NodeSpec,
    model: str,
    policy: PolicySpec,
    allowed_regions: frozenset[str] | None,
    live: Mapping[int, NodeLiveState],
    rtt_ms: Mapping[int, float],
) -> str | None:
    """Why ``node`` may not serve ``model`` for this gateway, or ``None`` when it may."""
    if model not in node.models:
        return NOT_SERVING
    if policy.model_scope and model not in policy.model_scope:
        return OUT_OF_SCOPE
    if node.state != "active":
        return node.state
    state = live.get(node.id)
    if state is not None and not state.healthy:
        return UNHEALTHY
    if allowed_regions is not None and node.region not in allowed_regions:
        return RESIDENCY
    if policy.max_rtt_ms is not None:
        rtt = rtt_ms.get(node.id)
        if rtt is not None and rtt > policy.max_rtt_ms:
            return RTT_TOO_HIGH
    return None


def eligible_nodes(
    snapshot: PolicySnapshot,
    model: str,
    gateway_region: str,
    live: Mapping[int, NodeLiveState],
    rtt_ms: Mapping[int, float],
) -> tuple[tuple[NodeSpec, ...], dict[str, int]]:
    """Candidates for ``model`` in stable id order, and a count of excluded nodes per reason.

    Nodes that do not serve the model at all are not counted as excluded.
    """
    allowed = allowed_node_regions(snapshot.policy, gateway_region)
    candidates: list[NodeSpec] = []
    excluded: dict[str, int] = {}
    for node in sorted(snapshot.nodes, key=lambda n: n.id):
        reason = exclusion_reason(node, model, snapshot.policy, allowed, live, rtt_ms)
        if reason is None:
            candidates.append(node)
        elif reason != NOT_SERVING:
            excluded[reason] = excluded.get(reason, 0) + 1
    return tuple(candidates), excluded
