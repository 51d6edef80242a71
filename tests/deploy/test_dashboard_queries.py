"""Every PromQL query of the Grafana dashboards and Prometheus rules parses and names only metrics
that gorgo or vLLM really export: checked against a live scrape of a real gateway process, a real
emulated vLLM node and a real control plane."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest

from tests.deploy.stack import send_traffic, start_stack
from tests.deploy.support import (
    DASHBOARD_FILES,
    ROOT,
    dashboard_queries,
    grafana_to_promql,
    metric_names,
    rules,
)

# Series Prometheus makes itself for every target.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}

# The front door's metrics (issue 12, names agreed in COORDINATION.md), not on main yet. This is
# the one list of names a query may use without a live scrape showing them; empty it when they land
# (the live test fails for any name here that a gateway already exports).
EXPECTED_FROM_FRONT_DOOR: dict[str, str] = {}

_TYPE_LINE = re.compile(r"^# TYPE (\S+) (\w+)$", re.MULTILINE)


def series_names(name: str, kind: str) -> set[str]:
    """The series names a metric family of this type exposes (as queries name them)."""
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    if kind == "summary":
        return {name, f"{name}_sum", f"{name}_count"}
    return {name}


def exported_names(exposition: str) -> set[str]:
    """Every series name a /metrics body declares, whether or not it has samples yet."""
    names = set()
    for name, kind in _TYPE_LINE.findall(exposition):
        names |= series_names(name, kind)
    return names


def used_names() -> dict[str, set[str]]:
    """Metric name -> where it is used, over every dashboard query and rule expression."""
    used: dict[str, set[str]] = {}
    for file_name, title, expr in dashboard_queries():
        for name in metric_names(grafana_to_promql(expr)):
            used.setdefault(name, set()).add(f"{file_name}: {title}")
    for file_name, rule in rules():
        for name in metric_names(rule["expr"]):
            used.setdefault(name, set()).add(f"{file_name}: {rule.get('alert') or rule.get('record')}")
    return used


def recorded_names() -> set[str]:
    return {rule["record"] for _file, rule in rules() if "record" in rule}


def test_it_has_three_dashboards_with_queries() -> None:
    assert {path.stem for path in DASHBOARD_FILES} == {"fleet", "gateway", "control-plane"}
    per_file: dict[str, int] = {}
    for file_name, _title, _expr in dashboard_queries():
        per_file[file_name] = per_file.get(file_name, 0) + 1
    assert all(count >= 5 for count in per_file.values()), per_file


def test_it_lays_out_panels_that_grafana_can_place() -> None:
    for path in DASHBOARD_FILES:
        dashboard = json.loads(path.read_text())
        ids = [panel["id"] for panel in dashboard["panels"]]
        cells: set[tuple[int, int]] = set()
        for panel in dashboard["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, (path.name, panel["title"])
            area = {
                (x, y)
                for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])
            }
            assert not area & cells, f"{path.name}: {panel['title']} overlaps another panel"
            cells |= area
            if panel["type"] != "row":
                assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                assert [target["refId"] for target in panel["targets"]] == [
                    chr(65 + i) for i in range(len(panel["targets"]))
                ]
        assert len(ids) == len(set(ids)), path.name
        assert dashboard["uid"].startswith("gorgo-") and dashboard["schemaVersion"] >= 36
        assert dashboard["templating"]["list"][0] == {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
        }


def test_it_parses_every_query_and_rule() -> None:
    failures = []
    for file_name, title, expr in dashboard_queries():
        try:
            assert metric_names(grafana_to_promql(expr)), "selects no metric"
        except (ValueError, AssertionError) as exc:
            failures.append(f"{file_name}: {title}: {expr}: {exc}")
    for file_name, rule in rules():
        try:
            metric_names(rule["expr"])
        except ValueError as exc:
            failures.append(f"{file_name}: {rule}: {exc}")
    assert failures == []


def test_it_catches_an_invalid_query_and_a_name_in_a_label_value() -> None:
    with pytest.raises(ValueError):
        metric_names("sum by (node (rate(x[5m]))")
    # Only selectors count: a string that looks like a metric name in a matcher is not one.
    assert metric_names('rate(gorgo_a_total{kind="gorgo_b_total"}[5m]) / on () group_left () c') == {
        "gorgo_a_total",
        "c",
    }


def test_it_keeps_the_dashboard_files_generated() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/grafana_dashboards.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 0, result.stderr


@pytest.mark.e2e
def test_it_uses_only_metric_names_a_live_gateway_node_and_control_plane_export(
    control_plane, processes, redis_url, redis_keys
) -> None:
    stack = start_stack(control_plane, processes, redis_url, redis_keys)
    send_traffic(stack, requests=1)
    gateway = stack.gateway_url

    gateway_body = httpx.get(f"{gateway}/metrics", timeout=10).text
    node_body = httpx.get(f"{stack.node_url}/metrics", timeout=10).text
    control_body = httpx.get(f"{stack.control_plane_url}/metrics", timeout=10).text
    gateway_names = exported_names(gateway_body)
    exported = gateway_names | exported_names(node_body) | exported_names(control_body)
    pending = set().union(*(series_names(name, kind) for name, kind in EXPECTED_FROM_FRONT_DOOR.items()))

    assert "vllm:time_to_first_token_seconds_bucket" in exported  # the node really was scraped
    assert "gorgo_rtt_seconds" in exported  # and the control plane
    # The TTFT SLO rules count the bucket le="1.0": that boundary must exist as exposed.
    assert re.search(r'^gorgo_gateway_ttft_seconds_bucket\{le="1\.0",node="us-east-1"\}', gateway_body, re.M)
    assert pending & gateway_names == set(), "exported now: remove from EXPECTED_FROM_FRONT_DOOR"
    known = exported | PROMETHEUS_SERIES | recorded_names() | pending
    unknown = {name: sorted(where) for name, where in used_names().items() if name not in known}
    assert unknown == {}, f"queries name metrics nobody exports: {unknown}"
