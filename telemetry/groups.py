"""The Channels group the dashboard listens on, and the update messages telemetry sends to it.

Only telemetry tasks send to the group (``telemetry.live.push_dashboard``); the dashboard's
consumer joins ``DASHBOARD_GROUP`` and handles one method per message type: Channels maps type
``telemetry.rtt`` to the consumer method ``telemetry_rtt``, and so on. Each message is a flat
msgpack-able dict with a ``type`` key; the shapes are documented in docs/telemetry.md and pinned
by tests/telemetry/test_dashboard_updates.py. Times are unix seconds, durations milliseconds.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

# The layer's own prefix (settings.CHANNEL_LAYERS) keeps fleets apart, so the name is fixed.
DASHBOARD_GROUP = "telemetry.dashboard"


class DashboardUpdate(msgspec.Struct, frozen=True, tag_field="type"):
    """Base of every update; ``type`` is the Channels handler name (``.`` -> ``_``)."""

    type_name: ClassVar[str] = ""

    def as_message(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class RTTCell(msgspec.Struct, frozen=True):
    """The RTT from one region to one node after a probe round (EWMA and jitter)."""

    node_id: int
    ok: bool
    rtt_ms: float | None = None  # EWMA; None if the probe failed and there is no history
    jitter_ms: float | None = None
    last_ms: float | None = None  # this round's sample
    connect_ms: float | None = None  # set when the probe had to open a new connection


class RTTUpdate(DashboardUpdate, frozen=True, tag="telemetry.rtt"):
    """After each probe round of one region."""

    type_name: ClassVar[str] = "telemetry.rtt"
    ts: float
    region: str
    cells: tuple[RTTCell, ...]


class NodeCell(msgspec.Struct, frozen=True):
    """One node after a scrape round."""

    node_id: int
    healthy: bool
    scrape_ok: bool
    num_running: float | None = None
    num_waiting: float | None = None
    kv_cache_usage: float | None = None  # 0..1
    prefix_hit_rate: float | None = None  # 0..1, tokens, over the scrape interval
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    ttft_p50_ms: float | None = None
    queue_mean_ms: float | None = None
    prefill_mean_ms: float | None = None
    error: str = ""


class NodesUpdate(DashboardUpdate, frozen=True, tag="telemetry.nodes"):
    """After each scrape round."""

    type_name: ClassVar[str] = "telemetry.nodes"
    ts: float
    nodes: tuple[NodeCell, ...]


class HealthUpdate(DashboardUpdate, frozen=True, tag="telemetry.health"):
    """A node changed health (sent once per transition, by the worker whose CAS won)."""

    type_name: ClassVar[str] = "telemetry.health"
    ts: float
    node_id: int
    node: str
    previous: str  # unknown | healthy | unhealthy
    current: str
    source: str  # the check that decided: probe | scrape
    reason: str


class Breakdown(msgspec.Struct, frozen=True):
    """Mean TTFT of a bucket and where it went; the parts add up to ``ttft_mean_ms``."""

    ttft_mean_ms: float
    gateway_ms: float
    network_ms: float
    queue_ms: float
    prefill_ms: float
    other_ms: float  # the remainder: TTFT minus the measured parts
    within_tolerance: bool  # |other| <= the stated tolerance (docs/telemetry.md)


class BucketCell(msgspec.Struct, frozen=True):
    """One request-aggregate bucket touched by the aggregation round (its values so far)."""

    scope: str  # node | region
    key: str  # node id (as text) or gateway region slug
    bucket_start: float
    count: int
    errors: int
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    breakdown: Breakdown | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0


class AggregatesUpdate(DashboardUpdate, frozen=True, tag="telemetry.aggregates"):
    """After each aggregation round that consumed records: the 10 s buckets it changed."""

    type_name: ClassVar[str] = "telemetry.aggregates"
    ts: float
    resolution: str
    buckets: tuple[BucketCell, ...]
