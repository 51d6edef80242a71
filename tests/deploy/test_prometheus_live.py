"""A real Prometheus (Debian's ``prometheus`` package, beside promtool) scrapes a live gateway, an
emulated vLLM node and the control plane with the label conventions of deploy/prometheus, loads the
rules, and evaluates every dashboard query and rule expression: each must run without a PromQL
error, and the queries over what this stack produces must return series with the right labels."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import yaml

from simulator.harness import free_port, wait_until
from tests.deploy.stack import NODE, REGION, send_traffic, start_stack
from tests.deploy.support import PROMETHEUS_DIR, dashboard_queries, rules
from tests.deploy.test_dashboard_queries import EXPECTED_FROM_FRONT_DOOR

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed"),
]
SCRAPE_S = 1


def prometheus_config(stack, rules_dir: Path) -> dict:
    """deploy/prometheus/prometheus.yml with its targets pointed at this stack's loopback ports:
    the same jobs, labels and relabelling, scraped every second, no token (loopback)."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"}
    config["rule_files"] = [str(rules_dir / "*.yml")]
    targets = {
        "gorgo-controlplane": ({}, stack.control_plane_url),
        "gorgo-gateway": ({"region": REGION}, stack.gateway_url),
        "vllm": ({"node": NODE, "region": REGION}, stack.node_url),
    }
    for job in config["scrape_configs"]:
        labels, url = targets[job["job_name"]]
        job.pop("authorization", None)
        job.pop("file_sd_configs", None)
        job["static_configs"] = [{"targets": [url.removeprefix("http://")], "labels": labels}]
    return config


def query(base: str, expr: str) -> list[dict]:
    response = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert body["status"] == "success", f"{expr}: {body.get('errorType')}: {body.get('error')}"
    return body["data"]["result"]


def dashboard_expr(expr: str) -> str:
    """A dashboard query as Grafana would send it: variables at "All", short rate windows."""
    for variable, value in (
        ("$__rate_interval", "30s"),
        ("$__interval", "30s"),
        ("$region", ".*"),
        ("$node", ".*"),
    ):
        expr = expr.replace(variable, value)
    return expr


def test_it_evaluates_every_dashboard_query_and_rule_on_a_real_prometheus(
    control_plane, processes, redis_url, redis_keys, tmp_path
) -> None:
    stack = start_stack(control_plane, processes, redis_url, redis_keys)
    (tmp_path / "rules").mkdir()
    for path in (PROMETHEUS_DIR / "rules").glob("*.yml"):
        document = yaml.safe_load(path.read_text())
        for group in document["groups"]:
            group["interval"] = f"{SCRAPE_S}s"  # evaluate within the test's time, not every 30 s
        (tmp_path / "rules" / path.name).write_text(yaml.safe_dump(document))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(stack, tmp_path / "rules")))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    processes.start(
        "prometheus",
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        ready_url=f"{base}/-/ready",
    )

    def scraped_and_evaluated() -> bool:
        send_traffic(stack, requests=1)  # traffic across several scrapes, so rate() has two points
        return (
            len(query(base, "up == 1")) == 3
            and bool(query(base, "count_over_time(gorgo_gateway_requests_total[1m]) > 3"))
            and bool(query(base, "gorgo:gateway_ttft_slo_errors:ratio_rate5m"))
        )

    wait_until(
        scraped_and_evaluated,
        60,
        what="Prometheus scraping all three targets and evaluating the rules",
        interval_s=SCRAPE_S,
        describe=lambda: f"{query(base, 'up')}\n{processes.logs()}",
    )

    # Every rule loaded and evaluates without error.
    groups = httpx.get(f"{base}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = [rule for group in groups for rule in group["rules"]]
    assert len(loaded) == sum(1 for _ in rules())
    assert [rule["name"] for rule in loaded if rule["health"] != "ok"] == [], loaded

    # Every dashboard query and rule expression runs; collect which ones return data.
    answered = {}
    for file_name, title, expr in dashboard_queries():
        answered[(file_name, title, expr)] = query(base, dashboard_expr(expr))
    for _file_name, rule in rules():
        query(base, rule["expr"])

    def series(file_name: str, title: str) -> list[dict]:
        found = [
            result for (name, panel, _expr), result in answered.items() if (name, panel) == (file_name, title)
        ]
        assert found, f"no panel {title!r} in {file_name}"
        return [item for result in found for item in result]

    by_region = series("fleet.json", "TTFT by gateway region (p50, p99)")
    assert {item["metric"].get("region") for item in by_region} == {REGION}
    by_node = series("fleet.json", "TTFT p99 by gateway region and node")
    assert {(item["metric"]["region"], item["metric"]["node"]) for item in by_node} == {(REGION, NODE)}
    breakdown = {
        item["metric"].get("node") for item in series("fleet.json", "TTFT breakdown by node (means)")
    }
    assert breakdown == {NODE}  # gateway and vLLM series join on the node label
    assert series("fleet.json", "KV-cache usage by node")[0]["metric"] == {"node": NODE}
    assert series("fleet.json", "Prefix-cache hit rate by node (tokens)")
    assert series("fleet.json", "Health as the control plane judges it") == []  # no workers run here
    assert {item["metric"]["status"] for item in series("gateway.json", "Requests per second by status")} == {
        "200"
    }
    assert series("gateway.json", "Routing decision time (p50, p99)")
    versions = series("control-plane.json", "Policy version per gateway vs published")
    assert {item["value"][1] for item in versions} == {"1"}  # the gateway runs what was published
    assert series("control-plane.json", "Request-log aggregation backlog")
    # Recording rules produce the SLO ratios with the gateway's region.
    assert query(base, "gorgo:gateway_ttft_slo_errors:ratio_rate5m")[0]["metric"] == {
        "__name__": "gorgo:gateway_ttft_slo_errors:ratio_rate5m",
        "region": REGION,
    }
    if not EXPECTED_FROM_FRONT_DOOR:  # the front door's panels, once its metrics exist
        breakers = series("gateway.json", "Circuit breaker state by gateway and node")
        assert {item["metric"]["node"] for item in breakers} == {NODE}
        by_key = series("gateway.json", "Requests per second by client key and priority")
        assert {item["metric"]["status_class"] for item in by_key} == {"2xx"}
        assert series("control-plane.json", "Client-key set version per gateway")
