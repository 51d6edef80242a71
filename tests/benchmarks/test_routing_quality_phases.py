"""A routing-quality run by phase (benchmarks/routing_quality_phases.py): without an outage, the
cold start against the rest, and how far gorgo's priced TTFT was from the TTFT it got."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

from routing.contract import SCHEMA_VERSION, CostTerms, RequestRecord
from simulator.traffic.runner import RequestResult
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other by name
import routing_quality_phases

WARMUP = 32  # 10 % of the default 320 measured requests


def _result(index: int, region: str, sent_s: float, ttft_ms: float | None, node: str) -> RequestResult:
    return RequestResult(
        index=index,
        client_region=region,
        conversation_id=f"c{index}",
        turn=0,
        target="http://127.0.0.1:1",
        scheduled_s=sent_s,
        sent_s=sent_s,
        status=200 if ttft_ms is not None else 0,
        ttft_ms=ttft_ms,
        node=node,
    )


def _record(
    at_s: float, gateway: str, node: str, priced_ms: float, ttft_ms: float, algorithm: str
) -> RequestRecord:
    return RequestRecord(
        schema_version=SCHEMA_VERSION,
        request_id=f"gw-{at_s}",
        ts=1_000.0 + at_s,
        gateway_region=gateway,
        gateway_id=f"bench-{gateway}",
        model="m",
        status=200,
        stream=True,
        node_id=1,
        node_region=node,
        algorithm=algorithm,
        ttft_ms=ttft_ms,
        cost=CostTerms(node_id=1, total_ms=priced_ms, rtt_ms=priced_ms / 2, prefill_ms=priced_ms / 2),
    )


def _write(raw: Path, name: str, results: list[RequestResult], records: list[RequestRecord]) -> None:
    (raw / f"{name}.jsonl").write_bytes(b"\n".join(msgspec.json.encode(r) for r in results))
    (raw / f"{name}.records.jsonl").write_bytes(b"\n".join(msgspec.json.encode(r) for r in records))


def test_a_run_without_an_outage_splits_into_its_cold_start_and_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = [_result(0, "eu-central", 0.0, 5_000.0, "eu-central-1")]  # warm-up: left out
    results += [_result(WARMUP + i, "eu-central", 1.0, 300.0, "ap-south-1") for i in range(2)]
    results += [_result(WARMUP + 2, "eu-central", 2.0, None, "")]  # no first token: inf
    results += [_result(WARMUP + 3 + i, "eu-central", 5.0, 30.0, "eu-central-2") for i in range(4)]
    records = [
        _record(0.0, "eu-central", "ap-south", 150.0, 1_150.0, "gorgo"),  # 1 s later than priced
        _record(4.0, "eu-central", "eu-central", 30.0, 35.0, "gorgo"),
        _record(4.5, "eu-central", "eu-central", 30.0, 900.0, "prefix_affinity"),  # not gorgo's estimate
    ]
    _write(tmp_path, "geo-chat@wan-redis-gorgo-1", results, records)
    assert routing_quality_phases.main([str(tmp_path), "--workload", "geo-chat@wan-redis"]) == 0
    out = capsys.readouterr().out
    assert "| policy | clients | cold | warm |" in out
    # cold: 300, 300, inf -> p50 300, p99 inf; one without a first token; the two placed were abroad
    assert "| gorgo | eu-central | 300 / inf (3; 1; 100%) | 30 / 30 (4; 0; 0%) |" in out
    assert "| gorgo | home | - | +5 / +5 (1) |" in out
    assert "| gorgo | abroad | +1,000 / +1,000 (1) | - |" in out


def test_an_unknown_workload_or_an_empty_directory_is_an_error_not_an_empty_table(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown workload"):
        routing_quality_phases.main([str(tmp_path), "--workload", "nope"])
    with pytest.raises(SystemExit, match="no geo-chat runs"):
        routing_quality_phases.main([str(tmp_path), "--workload", "geo-chat"])
