"""The Prometheus rules and config in deploy/prometheus: promtool checks them and runs their unit tests.

promtool comes from Debian's ``prometheus`` package (scripts/ensure_promtool.sh installs it for
``make test``); these tests skip only when it is truly missing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.support import PROMETHEUS_DIR, RULE_FILES, rules

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package prometheus; scripts/ensure_promtool.sh)"
)
TEST_FILES = sorted((PROMETHEUS_DIR / "tests").glob("*.test.yml"))


def promtool(*args: str, cwd: Path = PROMETHEUS_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_it_has_valid_rule_files() -> None:
    result = promtool("check", "rules", *map(str, RULE_FILES))

    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_it_passes_every_alert_unit_test() -> None:
    result = promtool("test", "rules", *map(str, TEST_FILES))

    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_it_has_a_valid_scrape_config_with_its_rules(tmp_path: Path) -> None:
    # The compose service writes the bearer token file at start; promtool wants it to exist.
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    token_file = tmp_path / "gorgo-metrics-token"
    token_file.write_text("token")
    for job in config["scrape_configs"]:
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(token_file)
    shutil.copytree(PROMETHEUS_DIR / "rules", tmp_path / "rules")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))

    result = promtool("check", "config", "prometheus.yml", cwd=tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr
    rule_count = sum(1 for _rule in rules())
    assert result.stdout.count("rules found") == len(RULE_FILES), result.stdout  # it read every file
    assert rule_count > 0


def test_it_unit_tests_every_alert_firing() -> None:
    alerts = {rule["alert"] for _file, rule in rules() if "alert" in rule}
    fired = set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                if check.get("exp_alerts"):
                    fired.add(check["alertname"])

    assert alerts, "no alerting rules found"
    assert alerts - fired == set(), f"alerts without a unit test that makes them fire: {alerts - fired}"


def test_it_scrapes_what_the_dashboards_and_rules_expect() -> None:
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}

    assert jobs == {"gorgo-controlplane", "gorgo-gateway", "vllm"}
    assert config["rule_files"] == ["rules/*.yml"]
