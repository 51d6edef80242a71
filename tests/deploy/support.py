"""Paths and PromQL helpers shared by the deploy/ tests (Prometheus rules, Grafana dashboards)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import promql_parser
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
DASHBOARD_FILES = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))

# Grafana's template variables, replaced by something of the same PromQL type before parsing.
_RANGE_VARIABLES = re.compile(r"\$__(rate_interval|interval|range)\b")
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")


def rules() -> Iterator[tuple[str, dict]]:
    """(file name, rule) for every recording and alerting rule."""
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                yield path.name, rule


def dashboard_queries() -> Iterator[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL) for every target and templating query."""
    for path in DASHBOARD_FILES:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                yield path.name, panel.get("title", ""), target["expr"]
        for variable in dashboard.get("templating", {}).get("list", []):
            if variable.get("type") == "query":
                query = variable["query"]
                text = query["query"] if isinstance(query, dict) else query
                match = re.fullmatch(r"label_values\((.+),\s*\w+\)", text.strip())
                if match:
                    yield path.name, f"variable {variable['name']}", match.group(1)


def grafana_to_promql(expr: str) -> str:
    """A dashboard query with its variables replaced, ready for a PromQL parser."""
    return _VARIABLE.sub(".*", _RANGE_VARIABLES.sub("5m", expr))


def metric_names(expr: str) -> set[str]:
    """Every metric name an expression selects (parsed, so label values and functions are not names)."""
    names: set[str] = set()

    def visit(node) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    names.add(matcher.value)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names
