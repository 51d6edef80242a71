"""Issue 24 policy runs: the per-seed routing_quality outputs in raw/ as one before/after table.

    python benchmarks/results/policy/summarize.py     # writes summary.json and summary.md beside it

raw/before-s<seed>.json: the old default gorgo (commit f136038: the mixed-length workload, the old
cost model); raw/after-*-s<seed>.json: this branch's gorgo and the alternatives, run in turns with
the old one per seed (same machine state as near as a shared machine allows). Targets as the
benchmark's report evaluates them (issue 24, item 3), on the medians over the seeds.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REGIONAL = ("vllm-router@local", "prefix_affinity@local")


def load() -> tuple[dict[str, dict[str, list[dict[str, Any]]]], list[dict[str, Any]]]:
    """workload -> policy -> per-seed figures ("gorgo (before)" for the old default); and metas."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    metas = []
    for path in sorted((HERE / "raw").glob("*.json")):
        document = json.loads(path.read_text())
        metas.append({"file": path.name, **{k: document["meta"][k] for k in ("command", "date", "seeds")}})
        before = path.name.startswith("before-")
        for workload, section in document["workloads"].items():
            for policy, seeds in section["policies"].items():
                name = "gorgo (before)" if before and policy == "gorgo" else policy
                runs.setdefault(workload, {}).setdefault(name, []).extend(seeds)
    return runs, metas


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for workload, policies in runs.items():
        rows = {}
        for policy, seeds in policies.items():
            regions = sorted({r for f in seeds for r in f["by_region"]})
            rows[policy] = {
                "seeds": len(seeds),
                "p50_ms": median([f["ttft_p50_ms"] for f in seeds]),
                "p99_ms": median([f["ttft_p99_ms"] for f in seeds]),
                "p50_each": [round(f["ttft_p50_ms"]) for f in seeds],
                "p99_each": [round(f["ttft_p99_ms"]) for f in seeds],
                "oracle_p50_ms": median([f["oracle_p50_ms"] for f in seeds if f.get("oracle_p50_ms")]),
                "cross_region_share": median([f["cross_region_share"] for f in seeds]),
                "send_lag_p99_ms": median([f["send_lag_p99_ms"] for f in seeds]),
                "region_p50_ms": {
                    r: median([f["by_region"][r]["ttft_p50_ms"] for f in seeds if r in f["by_region"]])
                    for r in regions
                },
            }
        out[workload] = {"policies": rows, "targets": targets(rows)}
    return out


def targets(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 24's criteria for the new default (and, beside it, what the old default reached)."""
    found = []
    for subject in ("gorgo", "gorgo (before)"):
        mine = rows.get(subject)
        if mine is None:
            continue
        others = {p: r for p, r in rows.items() if p not in ("gorgo", "gorgo (before)")}
        for figure, limit in (("p50_ms", 1.0), ("p99_ms", 1.05)):
            if others:
                best = min(others, key=lambda p: others[p][figure])
                ratio = mine[figure] / others[best][figure]
                found.append(
                    _target(
                        subject,
                        f"{figure[:3]} <= {limit:g}x every other",
                        best,
                        mine[figure],
                        others[best][figure],
                        ratio,
                        limit,
                    )
                )
        regional = {p: r for p, r in rows.items() if p in REGIONAL}
        for region, value in mine["region_p50_ms"].items():
            if regional:
                best = min(regional, key=lambda p: regional[p]["region_p50_ms"].get(region, float("inf")))
                theirs = regional[best]["region_p50_ms"][region]
                found.append(
                    _target(
                        subject,
                        f"{region} clients' p50 <= 1.05x regional",
                        best,
                        value,
                        theirs,
                        value / theirs,
                        1.05,
                    )
                )
        if mine["oracle_p50_ms"] == mine["oracle_p50_ms"]:
            ratio = mine["p50_ms"] / mine["oracle_p50_ms"]
            found.append(
                _target(
                    subject,
                    "p50 / oracle p50 (<= 1.5x on geo-chat)",
                    "oracle",
                    mine["p50_ms"],
                    mine["oracle_p50_ms"],
                    ratio,
                    None,
                )
            )
    return found


def _target(
    subject: str, name: str, against: str, mine: float, theirs: float, ratio: float, limit: float | None
) -> dict[str, Any]:
    return {
        "policy": subject,
        "target": name,
        "ms": round(mine, 1),
        "against": against,
        "against_ms": round(theirs, 1),
        "ratio": round(ratio, 3),
        "limit": limit,
        "met": None if limit is None else ratio <= limit,
    }


def markdown(summary: dict[str, Any], metas: list[dict[str, Any]]) -> str:
    lines = ["# Issue 24 policy runs: before/after, wall clock", ""]
    for workload, section in summary.items():
        lines += [
            f"## {workload}",
            "",
            "| policy | seeds | p50 ms | p99 ms | p50 each | p99 each | cross | send lag p99 | clients' p50 by region |",
            "|---|---:|---:|---:|---|---|---:|---:|---|",
        ]
        for policy, row in section["policies"].items():
            regions = ", ".join(f"{r} {v:,.0f}" for r, v in row["region_p50_ms"].items())
            lines.append(
                f"| {policy} | {row['seeds']} | {row['p50_ms']:,.0f} | {row['p99_ms']:,.0f} | {row['p50_each']} | {row['p99_each']} | "
                f"{row['cross_region_share']:.0%} | {row['send_lag_p99_ms']:,.0f} | {regions} |"
            )
        lines += [
            "",
            "| policy | target | ms | against | its ms | ratio | met |",
            "|---|---|---:|---|---:|---:|---|",
        ]
        for t in section["targets"]:
            met = "(reported)" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(
                f"| {t['policy']} | {t['target']} | {t['ms']:,.0f} | {t['against']} | {t['against_ms']:,.0f} | {t['ratio']:.2f} | {met} |"
            )
        lines.append("")
    lines += ["## Runs", ""] + [f"- `{m['file']}`: `{m['command']}` ({m['date']})" for m in metas]
    return "\n".join(lines) + "\n"


def main() -> None:
    runs, metas = load()
    summary = summarize(runs)
    (HERE / "summary.json").write_text(json.dumps({"runs": metas, "workloads": summary}, indent=1) + "\n")
    (HERE / "summary.md").write_text(markdown(summary, metas))


if __name__ == "__main__":
    main()
