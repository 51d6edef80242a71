"""What a page embeds when it is rendered: the fleet, the latest live state, the active policy.

The live state is read with telemetry's one reader (``telemetry.live.read_live_state``, as the
telemetry API does) from the same Redis keys the gateways use; when Redis is unreachable the page still renders, with the fleet and no live
values, and says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from controlplane.connections import redis_client, redis_keys
from controlplane.fleet.models import Node, Region
from controlplane.policies import publishing
from routing.contract import GatewayKVState, UnknownSchemaVersion, decode
from telemetry import live as telemetry_live
from telemetry.choices import HealthChoices
from telemetry.models import NodeHealth

log = logging.getLogger(__name__)


def fleet() -> dict[str, Any]:
    """Regions (with coordinates) and nodes, in the order every chart uses (region slug, name)."""
    regions = [
        {"slug": r.slug, "name": r.name, "lat": r.latitude, "lon": r.longitude}
        for r in Region.objects.order_by("slug")
    ]
    nodes = [
        {"id": n.pk, "name": n.name, "region": n.region.slug, "state": n.state}
        for n in Node.objects.select_related("region").order_by("region__slug", "name")
    ]
    return {"regions": regions, "nodes": nodes}


def _health_by_node() -> dict[int, str]:
    return dict(NodeHealth.objects.values_list("node_id", "health"))


def snapshot() -> dict[str, Any]:
    """The latest live node state and RTT table, as the telemetry workers last wrote them."""
    data: dict[str, Any] = {"ts": time.time(), "nodes": {}, "rtt": [], "error": ""}
    health = _health_by_node()
    for node_id, state in health.items():
        data["nodes"][str(node_id)] = {"node_id": node_id, "health": state}
    state = telemetry_live.read_live_state(redis_client(), redis_keys())
    if state.error:
        data["error"] = "Live state unavailable (Redis unreachable); showing the fleet only."
        return data
    for node_id, live in state.nodes.items():
        doc = msgspec.to_builtins(live)
        doc["health"] = health.get(node_id, HealthChoices.UNKNOWN)
        data["nodes"][str(node_id)] = doc
    if state.rtt is not None:
        data["rtt"] = [msgspec.to_builtins(entry) for entry in state.rtt.entries]
    return data


def active_policy() -> dict[str, Any] | None:
    """The policy the gateways run, and its version."""
    version = publishing.live_version()
    if version is None:
        return None
    return {
        "name": version.policy.name,
        "id": version.policy_id,
        "algorithm": version.policy.algorithm,
        "version": version.number,
        "author": version.author_name,
        "published_at": version.published_at.timestamp() if version.published_at else None,
    }


# A gateway's report older than this is ignored (it reports every 2 s; it may have stopped).
KV_STATE_STALE_S = 10.0


@dataclass(frozen=True, slots=True)
class KVIndexState:
    """How the gateways index one node's prefix cache: from its KV events or approximately."""

    mode: str  # "precise" (every reporting gateway), "approximate" (none), "mixed"
    lag_s: float | None  # the largest event lag any gateway saw
    blocks: int  # blocks the index holds for it (largest over gateways)
    gateways: int
    silent: bool = False  # some gateway sent it requests and got no KV event for a while


def kv_index_states() -> dict[int, KVIndexState]:
    """Node id -> the fresh gateways' view of it, for nodes that publish KV events ({} if Redis is down)."""
    try:
        raw = redis_client().hgetall(redis_keys().kv_state)
    except Exception as exc:  # the page renders without it
        log.warning("cannot read the gateways' KV-index state: %s", exc)
        return {}
    now = time.time()
    views: dict[int, list[Any]] = {}
    for value in raw.values():
        try:
            report = decode(value, GatewayKVState)
        except (UnknownSchemaVersion, msgspec.ValidationError, msgspec.DecodeError):
            continue
        if now - report.updated_at > KV_STATE_STALE_S:
            continue
        for node_id, state in report.nodes.items():
            views.setdefault(node_id, []).append(state)
    result: dict[int, KVIndexState] = {}
    for node_id, states in views.items():
        modes = {state.mode for state in states}
        lags = [state.lag_s for state in states if state.lag_s is not None]
        result[node_id] = KVIndexState(
            mode=modes.pop() if len(modes) == 1 else "mixed",
            lag_s=max(lags) if lags else None,
            blocks=max(state.blocks for state in states),
            gateways=len(states),
            silent=any(state.silent for state in states),
        )
    return result


@dataclass(frozen=True, slots=True)
class NodeRow:
    """A row of the nodes table, before the live columns are filled in by the page."""

    node: Node
    health: str
    kv_index: KVIndexState | None = None  # None: no gateway subscribes to its KV events


def node_rows() -> list[NodeRow]:
    health = _health_by_node()
    kv_states = kv_index_states()
    return [
        NodeRow(node=node, health=health.get(node.pk, HealthChoices.UNKNOWN), kv_index=kv_states.get(node.pk))
        for node in Node.objects.select_related("region").order_by("region__slug", "name")
    ]


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} ms"


def request_rows(record: dict[str, Any]) -> list[tuple[str, str]]:
    """One logged request (a ``RequestRecord`` as JSON) as labelled rows for the lookup panel."""
    node_name = "—"
    if record.get("node_id") is not None:
        node = Node.objects.filter(pk=record["node_id"]).values_list("name", flat=True).first()
        node_name = node or f"node {record['node_id']} (deleted)"
    cost = record.get("cost") or {}
    tokens = [record.get("prompt_tokens"), record.get("cached_tokens"), record.get("completion_tokens")]
    return [
        ("x-request-id", str(record.get("request_id", ""))),
        ("Arrived", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.get("ts", 0)))),
        ("Status", str(record.get("status"))),
        ("Error", record.get("error") or "—"),
        ("Gateway", f"{record.get('gateway_region')} · {record.get('gateway_id')}"),
        ("Node", f"{node_name} ({record.get('node_region') or '—'})"),
        ("Model", str(record.get("model"))),
        ("Policy", f"{record.get('algorithm') or '—'} · version {record.get('policy_version') or '—'}"),
        ("Client key", f"{record.get('key_id') or '—'} · {record.get('priority') or '—'}"),
        ("TTFT", _ms(record.get("ttft_ms"))),
        ("Total", _ms(record.get("total_ms"))),
        ("In the gateway", _ms(record.get("gateway_ms"))),
        ("RTT priced", _ms(cost.get("rtt_ms")) if cost else "—"),
        ("Prompt / cached / completion tokens", " / ".join("—" if t is None else str(t) for t in tokens)),
        ("Streamed", "yes" if record.get("stream") else "no"),
    ]
