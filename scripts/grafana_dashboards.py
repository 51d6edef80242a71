"""Writes gorgo's Grafana dashboards (deploy/grafana/dashboards/*.json) from one description.

    .venv/bin/python scripts/grafana_dashboards.py          # rewrite the JSON files
    .venv/bin/python scripts/grafana_dashboards.py --check  # exit 1 when a file is out of date

Panels are declared here so every dashboard shares one layout, datasource variable and style;
tests/deploy/test_dashboard_queries.py parses every query and checks its metric names against a
live scrape of a gateway, an emulated vLLM node and the control plane.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
GW = 'region=~"$region"'  # gateway series of the chosen gateway regions
NODE = 'node=~"$node"'  # vLLM series of the chosen nodes


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | table | state-timeline
    width: int = 12
    height: int = 8
    description: str = ""
    stacked: bool = False
    mappings: tuple[dict, ...] = ()
    transformations: tuple[dict, ...] = ()
    max_value: float | None = None


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variables: tuple[tuple[str, str, str], ...] = field(default=())  # (name, label, label_values query)


def q(expr: str, legend: str = "", instant: bool = False) -> Query:
    return Query(" ".join(expr.split()), legend, instant)


def quantiles(metric: str, by: str, selector: str, legend: str) -> tuple[Query, ...]:
    return tuple(
        q(
            f"histogram_quantile({quantile}, sum by ({by}, le) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"p{int(quantile * 100)} {legend}",
        )
        for quantile in (0.5, 0.99)
    )


def mean(metric: str, by: str, selector: str) -> str:
    return (
        f"sum by ({by}) (rate({metric}_sum{{{selector}}}[{RATE}]))"
        f" / sum by ({by}) (rate({metric}_count{{{selector}}}[{RATE}]))"
    )


BREAKER_STATES = (
    {
        "type": "value",
        "options": {
            "0": {"text": "closed", "color": "green"},
            "1": {"text": "half-open", "color": "yellow"},
            "2": {"text": "open", "color": "red"},
        },
    },
)
HEALTH_STATES = (
    {
        "type": "value",
        "options": {"0": {"text": "unhealthy", "color": "red"}, "1": {"text": "healthy", "color": "green"}},
    },
)

FLEET = Dashboard(
    uid="gorgo-fleet",
    title="gorgo / Fleet",
    description="TTFT by gateway region and node, where it goes, prefix cache, KV cache, RTT, node health.",
    variables=(
        ("region", "Gateway region", "label_values(gorgo_gateway_requests_total, region)"),
        ("node", "Node", "label_values(vllm:num_requests_running, node)"),
    ),
    rows=(
        Row(
            "Time to first token",
            (
                Panel(
                    "TTFT by gateway region (p50, p99)",
                    quantiles("gorgo_gateway_ttft_seconds", "region", GW, "{{region}}"),
                    unit="s",
                    description="Gateway arrival to first byte sent to the client, all nodes.",
                ),
                Panel(
                    "TTFT p99 by gateway region and node",
                    (
                        q(
                            "histogram_quantile(0.99, sum by (region, node, le) "
                            f'(rate(gorgo_gateway_ttft_seconds_bucket{{{GW}, node!="none"}}[{RATE}])))',
                            "{{region}} → {{node}}",
                        ),
                    ),
                    unit="s",
                ),
                Panel(
                    "TTFT breakdown by node (means)",
                    (
                        q(
                            mean("gorgo_gateway_ttft_seconds", "node", f'{GW}, node!="none"'),
                            "{{node}} at gateway",
                        ),
                        q(mean("vllm:time_to_first_token_seconds", "node", NODE), "{{node}} in vLLM"),
                        q(mean("vllm:request_queue_time_seconds", "node", NODE), "{{node}} queued"),
                        q(mean("vllm:request_prefill_time_seconds", "node", NODE), "{{node}} prefill"),
                    ),
                    unit="s",
                    width=24,
                    description=(
                        "At the gateway minus in vLLM = network round trip + gateway time; vLLM's TTFT = "
                        "queueing + prefill (+ scheduling). The RTT panel below shows the network part."
                    ),
                ),
            ),
        ),
        Row(
            "Caches",
            (
                Panel(
                    "Prefix-cache hit rate by node (tokens)",
                    (
                        q(
                            f"sum by (node) (rate(vllm:prefix_cache_hits_total{{{NODE}}}[{RATE}])) / "
                            f"sum by (node) (rate(vllm:prefix_cache_queries_total{{{NODE}}}[{RATE}]))",
                            "{{node}}",
                        ),
                    ),
                    unit="percentunit",
                    max_value=1,
                ),
                Panel(
                    "KV-cache usage by node",
                    (q(f"max by (node) (vllm:kv_cache_usage_perc{{{NODE}}})", "{{node}}"),),
                    unit="percentunit",
                    max_value=1,
                ),
            ),
        ),
        Row(
            "Network and load",
            (
                Panel(
                    "RTT matrix (rows: probing region, columns: node; EWMA)",
                    (q("max by (region, node) (gorgo_rtt_seconds)", instant=True),),
                    unit="s",
                    kind="table",
                    transformations=(
                        {
                            "id": "groupingToMatrix",
                            "options": {"rowField": "region", "columnField": "node", "valueField": "Value"},
                        },
                    ),
                ),
                Panel(
                    "Requests running and waiting by node",
                    (
                        q(f"sum by (node) (vllm:num_requests_running{{{NODE}}})", "{{node}} running"),
                        q(f"sum by (node) (vllm:num_requests_waiting{{{NODE}}})", "{{node}} waiting"),
                    ),
                ),
                Panel(
                    "Tokens per second by node",
                    (
                        q(
                            f"sum by (node) (rate(vllm:prompt_tokens_total{{{NODE}}}[{RATE}]))",
                            "{{node}} prompt",
                        ),
                        q(
                            f"sum by (node) (rate(vllm:generation_tokens_total{{{NODE}}}[{RATE}]))",
                            "{{node}} generated",
                        ),
                    ),
                ),
                Panel(
                    "Preemptions per second by node",
                    (q(f"sum by (node) (rate(vllm:num_preemptions_total{{{NODE}}}[{RATE}]))", "{{node}}"),),
                ),
            ),
        ),
        Row(
            "Node health",
            (
                Panel(
                    "Health as the control plane judges it",
                    (q("max by (node) (gorgo_node_healthy)", "{{node}}"),),
                    kind="state-timeline",
                    mappings=HEALTH_STATES,
                ),
                Panel(
                    "vLLM /metrics reachable by Prometheus",
                    (q('up{job="vllm"}', "{{node}}"),),
                    kind="state-timeline",
                    mappings=HEALTH_STATES,
                ),
            ),
        ),
    ),
)

GATEWAY = Dashboard(
    uid="gorgo-gateway",
    title="gorgo / Gateway",
    description="Requests by status, key and priority; limits, queue, breakers, retries, timeouts, decision time.",
    variables=(("region", "Gateway region", "label_values(gorgo_gateway_requests_total, region)"),),
    rows=(
        Row(
            "Traffic",
            (
                Panel(
                    "Requests per second by status",
                    (
                        q(
                            f"sum by (status) (rate(gorgo_gateway_requests_total{{{GW}}}[{RATE}]))",
                            "{{status}}",
                        ),
                    ),
                    unit="reqps",
                    stacked=True,
                ),
                Panel(
                    "Requests per second by node",
                    (q(f"sum by (node) (rate(gorgo_gateway_requests_total{{{GW}}}[{RATE}]))", "{{node}}"),),
                    unit="reqps",
                    stacked=True,
                ),
                Panel(
                    "Requests per second by client key and priority",
                    (
                        q(
                            "sum by (key_id, priority, status_class) "
                            f"(rate(gorgo_gateway_key_requests_total{{{GW}}}[{RATE}]))",
                            "{{key_id}} {{priority}} {{status_class}}",
                        ),
                    ),
                    unit="reqps",
                ),
                Panel(
                    "End-to-end duration (p50, p99)",
                    quantiles("gorgo_gateway_request_duration_seconds", "region", GW, "{{region}}"),
                    unit="s",
                ),
            ),
        ),
        Row(
            "Front door",
            (
                Panel(
                    "Rate-limited requests per second by key",
                    (
                        q(
                            f"sum by (key_id, reason) (rate(gorgo_gateway_rate_limited_total{{{GW}}}[{RATE}]))",
                            "{{key_id}} {{reason}}",
                        ),
                    ),
                    unit="reqps",
                ),
                Panel(
                    "Authentication failures per second",
                    (
                        q(
                            f"sum by (reason) (rate(gorgo_gateway_auth_failures_total{{{GW}}}[{RATE}]))",
                            "{{reason}}",
                        ),
                    ),
                    unit="reqps",
                ),
                Panel(
                    "Queue length by priority",
                    (q(f"sum by (priority) (gorgo_gateway_queue_length{{{GW}}})", "{{priority}}"),),
                ),
                Panel(
                    "Queue wait (p50, p99)",
                    quantiles("gorgo_gateway_queue_wait_seconds", "priority", GW, "{{priority}}"),
                    unit="s",
                ),
                Panel(
                    "Queue rejections per second",
                    (
                        q(
                            "sum by (priority, reason) "
                            f"(rate(gorgo_gateway_queue_rejected_total{{{GW}}}[{RATE}]))",
                            "{{priority}} {{reason}}",
                        ),
                    ),
                    unit="reqps",
                ),
                Panel(
                    "Circuit breaker state by gateway and node",
                    (
                        q(
                            f"max by (instance, node) (gorgo_gateway_breaker_state{{{GW}}})",
                            "{{instance}} → {{node}}",
                        ),
                    ),
                    kind="state-timeline",
                    mappings=BREAKER_STATES,
                ),
                Panel(
                    "Connections open and rejected",
                    (
                        q(f"sum by (instance) (gorgo_gateway_connections_open{{{GW}}})", "{{instance}} open"),
                        q(
                            f"sum by (instance) (rate(gorgo_gateway_connections_rejected_total{{{GW}}}[{RATE}]))",
                            "{{instance}} rejected/s",
                        ),
                    ),
                ),
            ),
        ),
        Row(
            "Upstream",
            (
                Panel(
                    "Retries per second by reason",
                    (
                        q(
                            f"sum by (reason) (rate(gorgo_gateway_retries_total{{{GW}}}[{RATE}]))",
                            "{{reason}}",
                        ),
                    ),
                    unit="reqps",
                ),
                Panel(
                    "Timeouts and upstream errors per second",
                    (
                        q(
                            f"sum by (kind) (rate(gorgo_gateway_timeouts_total{{{GW}}}[{RATE}]))",
                            "timeout {{kind}}",
                        ),
                        q(
                            f"sum by (node, kind) (rate(gorgo_gateway_upstream_errors_total{{{GW}}}[{RATE}]))",
                            "{{node}} {{kind}}",
                        ),
                    ),
                    unit="reqps",
                ),
                Panel(
                    "In-flight requests and prefill tokens by node",
                    (
                        q(f"sum by (node) (gorgo_gateway_inflight_requests{{{GW}}})", "{{node}} requests"),
                        q(
                            f"sum by (node) (gorgo_gateway_inflight_prefill_tokens{{{GW}}})",
                            "{{node}} prefill tokens",
                        ),
                    ),
                ),
                Panel(
                    "Routing decision time (p50, p99)",
                    quantiles("gorgo_gateway_routing_decision_seconds", "region", GW, "{{region}}"),
                    unit="s",
                ),
                Panel(
                    "Measured round trip by gateway and node",
                    (
                        q(
                            f"max by (instance, node) (gorgo_gateway_node_measured_rtt_seconds{{{GW}}})",
                            "{{instance}} to {{node}}",
                        ),
                    ),
                    unit="s",
                    description="What each gateway measures from its own streams (request sent to the "
                    "response head) and gorgo routes on, in place of the probed RTT (docs/routing.md, "
                    '"Measured inputs").',
                ),
                Panel(
                    "Measured prefill speed by node",
                    (
                        q(
                            "max by (instance, node) "
                            f"(gorgo_gateway_node_measured_prefill_tokens_per_second{{{GW}}})",
                            "{{instance}} sees {{node}}",
                        ),
                    ),
                    unit="none",
                    description="Prompt tokens per second each gateway measures a node prefills at (head to "
                    "first token of answers with no queue known ahead); gorgo routes on it in place of the "
                    "configured speed. Far from the node's configured speed: the configuration is off.",
                ),
                Panel(
                    "How late each gateway sees its peers",
                    (
                        q(
                            f"max by (instance, peer) (gorgo_gateway_peer_update_delay_seconds{{{GW}}})",
                            "{{instance}}: {{peer}}'s updates",
                        ),
                        q(
                            f"max by (instance, peer) (gorgo_gateway_peer_load_age_seconds{{{GW}}})",
                            "{{instance}}: {{peer}}'s load report",
                        ),
                    ),
                    unit="s",
                    width=24,
                    description="How late a peer gateway's prefix updates (its claims on a node's queue) "
                    "arrive, and how old its load report was when read. Over a WAN-far Redis this is a "
                    "round trip and more: a forward priced on a node abroad does not see what that "
                    "node's own region sent it since (docs/deployment.md, where Redis lives).",
                ),
                Panel(
                    "Request log to Redis",
                    (
                        q(
                            f"sum by (instance) (rate(gorgo_gateway_request_log_written_total{{{GW}}}[{RATE}]))",
                            "{{instance}} written/s",
                        ),
                        q(
                            f"sum by (instance) (rate(gorgo_gateway_request_log_dropped_total{{{GW}}}[{RATE}]))",
                            "{{instance}} dropped/s",
                        ),
                        q(
                            f"sum by (instance) (gorgo_gateway_request_log_pending{{{GW}}})",
                            "{{instance}} pending",
                        ),
                    ),
                    width=24,
                ),
            ),
        ),
    ),
)

CONTROL_PLANE = Dashboard(
    uid="gorgo-control-plane",
    title="gorgo / Control plane",
    description="Policy version per gateway, publishes, Redis, telemetry task lag.",
    rows=(
        Row(
            "Policy",
            (
                Panel(
                    "Policy version per gateway vs published",
                    (
                        q(
                            "max by (instance, region) (gorgo_gateway_policy_version)",
                            "{{region}} {{instance}}",
                        ),
                        q("max(gorgo_controlplane_policy_version)", "published"),
                    ),
                    description="Every gateway should follow the published version within a second.",
                ),
                Panel(
                    "Publishes per policy (in the interval)",
                    (
                        q(
                            "sum by (policy) (increase(gorgo_controlplane_policy_publishes_total[$__interval]))",
                            "{{policy}}",
                        ),
                    ),
                    stacked=True,
                ),
                Panel(
                    "Policy events at the gateways",
                    (
                        q(
                            f"sum by (event) (increase(gorgo_gateway_policy_events_total[{RATE}]))",
                            "{{event}}",
                        ),
                    ),
                    description="Snapshots swapped in, and refused by reason.",
                ),
                Panel(
                    "Since the last publish",
                    (q("time() - max(gorgo_controlplane_policy_published_timestamp_seconds)", instant=True),),
                    unit="s",
                    kind="stat",
                    width=6,
                ),
                Panel(
                    "Client-key set version per gateway",
                    (
                        q(
                            "max by (instance, region) (gorgo_gateway_keyset_version)",
                            "{{region}} {{instance}}",
                        ),
                    ),
                    width=6,
                ),
            ),
        ),
        Row(
            "Redis",
            (
                Panel(
                    "Redis reachable",
                    (
                        q(
                            "max by (instance, region) (gorgo_gateway_redis_connected)",
                            "gateway {{region}} {{instance}}",
                        ),
                        q("max(gorgo_controlplane_redis_up)", "control plane"),
                    ),
                    kind="state-timeline",
                    mappings=HEALTH_STATES,
                    width=24,
                ),
            ),
        ),
        Row(
            "Telemetry tasks",
            (
                Panel(
                    "Probe lag by probing region",
                    (q("time() - max by (region) (gorgo_rtt_updated_timestamp_seconds)", "{{region}}"),),
                    unit="s",
                    description="Since the newest successful RTT probe from the region (queue probe.<region>).",
                ),
                Panel(
                    "Scrape lag by node",
                    (
                        q(
                            "time() - max by (node) (gorgo_telemetry_last_scrape_timestamp_seconds)",
                            "{{node}}",
                        ),
                    ),
                    unit="s",
                    description="Since the node's last successful /metrics scrape by the workers.",
                ),
                Panel(
                    "Request-log aggregation backlog",
                    (
                        q("max(gorgo_telemetry_request_stream_lag)", "not read yet"),
                        q("max(gorgo_telemetry_request_stream_pending)", "read, not acknowledged"),
                    ),
                    width=24,
                ),
            ),
        ),
    ),
)

DASHBOARDS = (FLEET, GATEWAY, CONTROL_PLANE)


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    defaults: dict = {"unit": panel.unit}
    if panel.max_value is not None:
        defaults["max"] = panel.max_value
        defaults["min"] = 0
    if panel.mappings:
        defaults["mappings"] = list(panel.mappings)
    if panel.kind == "timeseries":
        defaults["custom"] = {"stacking": {"mode": "normal" if panel.stacked else "none"}, "fillOpacity": 10}
    result = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": panel.width, "h": panel.height},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]}}
        if panel.kind == "timeseries"
        else {},
        "targets": [
            {
                "refId": chr(ord("A") + index),
                "datasource": DATASOURCE,
                "expr": query.expr,
                "legendFormat": query.legend,
                "instant": query.instant,
                "range": not query.instant,
                **({"format": "table"} if panel.kind == "table" else {}),
            }
            for index, query in enumerate(panel.queries)
        ],
    }
    if panel.transformations:
        result["transformations"] = list(panel.transformations)
    return result


def dashboard_json(dashboard: Dashboard) -> dict:
    panels: list[dict] = []
    panel_id, y = 1, 0
    for row in dashboard.rows:
        panels.append({"id": panel_id, "type": "row", "title": row.title, "collapsed": False, "panels": [],
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}})  # fmt: skip
        panel_id, y, x, row_height = panel_id + 1, y + 1, 0, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y, row_height = 0, y + row_height, 0
            panels.append(panel_json(panel, panel_id, x, y))
            panel_id, x, row_height = panel_id + 1, x + panel.width, max(row_height, panel.height)
        y += row_height
    variables = [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
        }
    ]
    for name, label, query in dashboard.variables:
        variables.append(
            {
                "name": name,
                "label": label,
                "type": "query",
                "datasource": DATASOURCE,
                "query": {"query": query, "refId": f"{name}-values"},
                "refresh": 2,
                "includeAll": True,
                "multi": True,
                "allValue": ".*",
                "current": {"text": "All", "value": "$__all"},
                "sort": 1,
            }
        )
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["gorgo"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": variables},
        "annotations": {"list": []},
        "links": [{"title": "gorgo", "type": "dashboards", "tags": ["gorgo"], "asDropdown": True}],
        "panels": panels,
    }


def rendered() -> dict[Path, str]:
    return {
        OUT_DIR / f"{dashboard.uid.removeprefix('gorgo-')}.json": json.dumps(
            dashboard_json(dashboard), indent=2, ensure_ascii=False
        )
        + "\n"
        for dashboard in DASHBOARDS
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a dashboard file is out of date")
    args = parser.parse_args()
    stale = [path for path, text in rendered().items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"out of date: {path} (run scripts/grafana_dashboards.py)", file=sys.stderr)
        return 1 if stale else 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for path, text in rendered().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
