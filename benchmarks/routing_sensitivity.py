"""Routing sensitivity: how far gorgo degrades when it is told wrong inputs, and whether the online
tuner recovers (issue 24, item 4).

    python benchmarks/routing_sensitivity.py --part static    # the wrong inputs side by side, ~7 min
    python benchmarks/routing_sensitivity.py --part tuner --tuner-variant "prefill x2"   # ~7 min
    python benchmarks/routing_sensitivity.py --part tuner --tuner-variant correct        # the reference

Both parts run on the wall-clock fleet of ``benchmarks/routing_quality.py`` (its harness: the
emulated nodes, one real gateway per region, the seeded geo-chat traffic), reused, not copied.

**static**: gorgo on geo-chat with correct inputs and with each wrong one (``VARIANTS``): the nodes'
prefill speed told 2x too fast or too slow (every node's ``prefill_tokens_per_s`` in the policy;
the nodes run at the real one) and an RTT table 30 % too long or too short (every entry of the
``live_rtt`` table). Seeds in turns, so machine noise hits every variant.

**tuner**: the control plane's online tuner (``controlplane/policies/tuning.py``, its real code)
drives the policy versions of a live fleet told one wrong input: a SQLite database of the run's
own with the fleet's regions, model and nodes (the wrong prefill speed in ``Node``), a gorgo
policy with ``auto_tune`` published through ``publishing.publish`` to the run's Redis prefix, the
gateways following it, geo-chat traffic for ``--tuner-minutes``, and ``tune_policy`` called every
second (what the ``policies.tune`` beat task does every window/5). Each trial is a canary on
``TUNER_CANARY_PERCENT`` of the sessions; a window is ``TUNER_WINDOW_S`` with at least
``TUNER_MIN_REQUESTS`` answered requests per arm (the settings' minimum is 5 s / 20; the defaults,
300 s / 200, would make this run hours). A trial runs until the tuner's promotion rule decides
(``tuner_math.compare_arms``: faster with confidence, or not, or ``MAX_WINDOWS_PER_TRIAL`` windows
spent), so one decision spans one or more windows. Reported: every decision (trial weights, the
windows it took, both arms' p95, the decision) and, per 10 s window of the run, the TTFT of the
requests served with the live weights (everything but a running trial's arm), against the run on
correct inputs at the same window (same seed, same traffic); "recovered" is the first window from
which the live weights' geometric-mean TTFT over the rest of the run is within ``RECOVERED_WITHIN``
of the correct run's over the same windows. One part or tuner variant per invocation (Django is set
up once per process); each invocation merges what it measured into the output.

Why the weights can undo these errors: gorgo's cost is ``w_rtt * rtt + w_queue * queue + prefill``
and both queue and prefill are divided by the prefill speed. A speed told k times too fast divides
the queue and prefill terms by k, which ranks the nodes as ``w_rtt * k`` would with the right speed:
``w_rtt = 1/k`` undoes it. An RTT table k times too long is ``w_rtt * k``: ``w_rtt = 1/k`` again.
The tuner searches (w_rtt, w_queue), so it can reach both corrections when the error is the same
on every node; a per-node error it cannot (the same weight scales every node's term).

Results: benchmarks/results/routing_sensitivity.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis
import routing_quality as rq  # this directory is on sys.path
from routing_quality_report import RunFigures, over_seeds, summarize_run

from routing.contract import RedisKeys, RequestRecord, decode
from simulator.harness import exit_on_sigterm
from simulator.topology import load_topology
from simulator.traffic import build_plan, run_plan
from simulator.traffic.report import percentile

ROOT = rq.ROOT
OUT = rq.RESULTS / "routing_sensitivity"
SCENARIO = rq.SCENARIOS["geo-chat"]
# name -> (told prefill speed / real, told RTT / real)
VARIANTS: dict[str, tuple[float, float]] = {
    "correct": (1.0, 1.0),
    "prefill x2": (2.0, 1.0),  # told twice as fast as the nodes are
    "prefill x0.5": (0.5, 1.0),
    "rtt x1.3": (1.0, 1.3),
    "rtt x0.7": (1.0, 0.7),
}
TUNER_WINDOW_S = 10.0
TUNER_MIN_REQUESTS = 60
# A third of the static runs' rate: over minutes the emulated fleet on this 2-core machine cannot
# keep up with geo-chat's 42/s (a first try's window p95 grew from 0.6 s to 33 s in 90 s), and a
# queue that only grows is not a policy to tune.
TUNER_RATE_RPS = 14.0
TUNER_CANARY_PERCENT = 50.0
TUNER_TICK_S = 1.0
RECOVERED_WITHIN = 1.10  # the live weights' geometric-mean TTFT within 10 % of the correct inputs'


# ---- static --------------------------------------------------------------------------------------


def records_p95(records: list[RequestRecord], warmup_ts: float | None = None) -> float | None:
    """p95 TTFT of the answered requests in the gateways' records (the tuner's measure)."""
    values = [
        r.ttft_ms
        for r in records
        if r.status == 200 and r.ttft_ms is not None and (warmup_ts is None or r.ts >= warmup_ts)
    ]
    return percentile(values, 95)


MEASURED_MODES = ("told", "measured")


def static_variants(
    modes: tuple[str, ...], chosen: set[str] | None = None
) -> list[tuple[str, tuple[float, float], bool]]:
    """Each wrong input with the gateways routing on the told values only (``told``: gorgo before
    issue 24's measured inputs) and on what they measure (``measured``, the default); ``correct``
    once per mode too, so each mode has its own reference."""
    return [
        (f"{name} ({mode})" if len(modes) > 1 else name, scales, mode == "measured")
        for mode in modes
        for name, scales in VARIANTS.items()
        if chosen is None or name in chosen
    ]


def run_static(
    seeds: list[int],
    requests: int,
    redis_url: str,
    workdir: Path,
    measured_modes: tuple[str, ...] = MEASURED_MODES,
    chosen: set[str] | None = None,
    warmup_requests: int | None = None,
) -> dict[str, Any]:
    topology = load_topology(SCENARIO.topology_path)
    rate = rq.scenario_rate(SCENARIO, topology)
    figures: dict[str, list[RunFigures]] = {}
    gateway_p95: dict[str, list[float]] = {}
    corrections: dict[str, list[dict[str, Any]]] = {}
    for seed in seeds:
        for name, (prefill_scale, rtt_scale), measured in static_variants(measured_modes, chosen):
            print(f"static seed {seed} {name:<30}", end=" ", flush=True)
            output = rq.run_once(
                rq.RunSpec(
                    SCENARIO,
                    "gorgo",
                    rate,
                    requests,
                    seed,
                    param_overrides={"measured_inputs": measured},
                    told_prefill_scale=prefill_scale,
                    told_rtt_scale=rtt_scale,
                    warmup_requests=warmup_requests,
                ),
                topology,
                redis_url,
                workdir,
                None,
            )
            run = summarize_run(output, rq.PREFILL_TOKENS_PER_S)
            figures.setdefault(name, []).append(run)
            if measured:
                corrections.setdefault(name, []).append(
                    correction_times(output.records, topology, prefill_scale, rtt_scale)
                )
            ordered = sorted(output.records, key=lambda r: r.ts)
            warm_ts = ordered[min(output.warmup_requests, len(ordered) - 1)].ts if ordered else None
            p95 = records_p95(output.records, warm_ts)
            if p95 is not None:
                gateway_p95.setdefault(name, []).append(p95)
            print(
                f"p50 {run.ttft_p50_ms:.0f} p99 {run.ttft_p99_ms:.0f} ms, cross {run.cross_region_share:.0%},"
                f" hit {run.prefix_hit_rate:.0%}, send lag p99 {run.send_lag_p99_ms:.0f} ms",
                flush=True,
            )
    rows: dict[str, Any] = {}
    for name, (prefill_scale, rtt_scale), measured in static_variants(measured_modes, chosen):
        runs = figures[name]
        # each mode against its own correct-inputs runs
        correct = figures[
            next(
                n
                for n, scales, m in static_variants(measured_modes, chosen)
                if m == measured and scales == (1.0, 1.0)
            )
        ]
        row: dict[str, Any] = {
            "told_prefill_scale": prefill_scale,
            "told_rtt_scale": rtt_scale,
            "measured_inputs": measured,
        }
        for label, pick in (
            ("p50", lambda f: f.ttft_p50_ms),
            ("p90", lambda f: f.ttft_p90_ms),
            ("p99", lambda f: f.ttft_p99_ms),
            ("cross_region_share", lambda f: f.cross_region_share),
            ("prefix_hit_rate", lambda f: f.prefix_hit_rate),
        ):
            mine, base = over_seeds(runs, pick), over_seeds(correct, pick)
            assert mine is not None and base is not None
            row[label] = {"median": mine.median, "low": mine.low, "high": mine.high}
            if label in ("p50", "p90", "p99"):
                row[label]["vs_correct"] = round(mine.median / base.median, 3) if base.median else None
        row["gateway_p95_ms"] = gateway_p95.get(name, [])
        if name in corrections:
            row["corrections"] = corrections[name]
        row["runs"] = [f.to_json() for f in runs]
        rows[name] = row
    return {
        "rate_rps": rate,
        "requests_per_run": requests,
        "warmup_requests": warmup_requests
        if warmup_requests is not None
        else round(requests * rq.WARMUP_SHARE),
        "seeds": seeds,
        "variants": rows,
    }


# How close to the truth a decision's input must be to count as corrected.
CORRECTED_WITHIN = 0.15


def correction_times(
    records: list[RequestRecord], topology: Any, prefill_scale: float, rtt_scale: float
) -> dict[str, Any]:
    """When the gateways' decisions stopped using the wrong inputs, read off their cost terms:
    a decision's milliseconds per prefill token are its ``prefill_ms / uncached_tokens`` (the
    speed it priced the chosen node at), its round trip to a node abroad its ``rtt_ms``. Per
    gateway, the seconds from its first request to the first decision from which every later one
    is within ``CORRECTED_WITHIN`` of the truth (None: never); and the values in use at the end."""
    true_ms_per_token = 1000.0 / rq.PREFILL_TOKENS_PER_S
    by_gateway: dict[str, list[RequestRecord]] = {}
    for record in sorted(records, key=lambda r: r.ts):
        if record.cost is not None:
            by_gateway.setdefault(record.gateway_region, []).append(record)
    out: dict[str, Any] = {}
    for region, rows in sorted(by_gateway.items()):
        start = rows[0].ts
        speeds = [
            (r.ts, r.cost.prefill_ms / r.cost.uncached_tokens)
            for r in rows
            if r.cost is not None and r.cost.uncached_tokens >= 64
        ]
        rtts = [
            (
                r.ts,
                r.cost.rtt_ms,
                topology.rtt_ms(region, r.node_region) + topology.jitter_ms(region, r.node_region) / 2,
            )
            for r in rows
            if r.cost is not None and r.node_region is not None and r.node_region != region
        ]

        def settled(values: list[tuple[float, bool]], start: float = start) -> float | None:
            last_wrong = None
            for ts, right in values:
                if not right:
                    last_wrong = ts
            if not values or (last_wrong is not None and last_wrong == values[-1][0]):
                return None
            return 0.0 if last_wrong is None else last_wrong - start

        out[region] = {
            "speed_corrected_after_s": settled(
                [(ts, abs(v / true_ms_per_token - 1) <= CORRECTED_WITHIN) for ts, v in speeds]
            ),
            "ms_per_token_at_end": speeds[-1][1] if speeds else None,
            "rtt_corrected_after_s": settled(
                [(ts, abs(used / real - 1) <= CORRECTED_WITHIN) for ts, used, real in rtts]
            ),
            "forwards": len(rtts),
        }
    return {"told_prefill_scale": prefill_scale, "told_rtt_scale": rtt_scale, "gateways": out}


# ---- tuner ---------------------------------------------------------------------------------------


def _setup_django(prefix: str, redis_url: str, workdir: Path) -> None:
    """A control plane of this run's own: SQLite in ``workdir``, Redis keys under ``prefix``."""
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "DATABASE_URL": f"sqlite:///{workdir / 'tuner.sqlite3'}",
            "REDIS_URL": redis_url,
            "GORGO_REDIS_PREFIX": prefix,
            "GORGO_TUNER_WINDOW_S": str(TUNER_WINDOW_S),
            "GORGO_TUNER_MIN_REQUESTS": str(TUNER_MIN_REQUESTS),
            "GORGO_TUNER_CANARY_PERCENT": str(TUNER_CANARY_PERCENT),
        }
    )
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def _register_fleet(topology: Any, fleet: rq.FleetProc, prefill_scale: float) -> None:
    """The fleet as an operator registers it, with the wrong prefill speed in every node."""
    from controlplane.fleet.models import LLMModel, Node, Region

    model = LLMModel.objects.create(
        name=topology.nodes[0].model,
        kv_block_size=topology.nodes[0].engine.block_size,
        max_context_tokens=rq.MAX_MODEL_LEN,
    )
    regions = {
        r.slug: Region.objects.create(slug=r.slug, name=r.name, latitude=r.latitude, longitude=r.longitude)
        for r in topology.regions
    }
    for spec, described in zip(topology.nodes, fleet.nodes, strict=True):
        node = Node.objects.create(
            name=spec.name,
            region=regions[spec.region],
            base_url=described["url"],
            gpu_type=spec.gpu_type,
            gpu_count=spec.gpu_count,
            max_num_seqs=spec.engine.max_num_seqs,
            prefill_tokens_per_s=rq.PREFILL_TOKENS_PER_S * prefill_scale,
            kv_capacity_tokens=rq.KV_CAPACITY_BLOCKS * spec.engine.block_size,
        )
        node.served_models.add(model)


def _tuner_loop(policy_id: int, stop: threading.Event, errors: list[str]) -> None:
    """What the ``policies.tune`` beat task does, every ``TUNER_TICK_S``."""
    from django.db import close_old_connections

    from controlplane.policies import tuning
    from controlplane.policies.models import RoutingPolicy

    try:
        while not stop.wait(TUNER_TICK_S):
            window = tuning.tune_policy(RoutingPolicy.objects.get(pk=policy_id), time.time())
            if window is not None:
                print(
                    f"  window {window.pk}: w_rtt {window.w_rtt:.3g} w_queue {window.w_queue:.3g}"
                    f" p95 {window.p95_ms:.0f} ms over {window.requests}: {window.outcome}",
                    flush=True,
                )
    except Exception as exc:  # reported in the results; the traffic stops with the run
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        close_old_connections()


def _arm_p95s(client: redis.Redis, keys: RedisKeys) -> dict[int, dict[str, Any]]:
    """Per canary: each arm's p95 TTFT and count, from the gateways' request records."""
    arms: dict[int, dict[str, list[float]]] = {}
    for _id, fields in client.xrange(keys.request_stream):
        record = decode(fields[b"r"], RequestRecord)
        if record.canary_id is None or record.arm is None or record.status != 200 or record.ttft_ms is None:
            continue
        arms.setdefault(record.canary_id, {"live": [], "canary": []})[record.arm].append(record.ttft_ms)
    return {
        canary: {
            arm: {"p95_ms": percentile(values, 95), "requests": len(values)} for arm, values in by_arm.items()
        }
        for canary, by_arm in arms.items()
    }


def time_windows(client: redis.Redis, keys: RedisKeys, started_s: float) -> list[dict[str, Any]]:
    """Per ``TUNER_WINDOW_S`` of the run: TTFTs of the requests the live weights served (no canary
    running, or a canary's ``live`` arm) and of a trial's arm, from the gateways' request records."""
    buckets: dict[int, dict[str, list[float]]] = {}
    for _id, fields in client.xrange(keys.request_stream):
        record = decode(fields[b"r"], RequestRecord)
        if record.status != 200 or record.ttft_ms is None or record.ts < started_s:
            continue
        index = int((record.ts - started_s) // TUNER_WINDOW_S)
        arm = "trial" if record.canary_id is not None and record.arm == "canary" else "live"
        buckets.setdefault(index, {"live": [], "trial": []})[arm].append(record.ttft_ms)
    found = []
    for index in sorted(buckets):
        live, trial = buckets[index]["live"], buckets[index]["trial"]
        found.append(
            {
                "window": index + 1,
                "live_requests": len(live),
                "live_p50_ms": percentile(live, 50),
                "live_p95_ms": percentile(live, 95),
                "live_geomean_ms": geomean(live),
                "trial_requests": len(trial),
                "trial_p95_ms": percentile(trial, 95),
            }
        )
    return found


def geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(max(v, 1e-3)) for v in values)) if values else None


def run_tuner(
    variant: str,
    minutes: float,
    seed: int,
    rate: float,
    redis_url: str,
    workdir: Path,
    measured: bool = False,
) -> dict[str, Any]:
    prefill_scale, rtt_scale = VARIANTS[variant]
    topology = load_topology(SCENARIO.topology_path)
    prefix = f"gorgobench-sens-{uuid.uuid4().hex[:12]}"
    keys = RedisKeys(prefix=prefix)
    _setup_django(prefix, redis_url, workdir)
    from controlplane.policies import publishing
    from controlplane.policies.models import PolicyExperiment, RoutingPolicy

    client = redis.Redis.from_url(redis_url)
    fleet = rq.start_fleet(workdir, SCENARIO.topology_path)
    procs: list[rq.Proc] = [fleet.proc]
    stop = threading.Event()
    errors: list[str] = []
    try:
        _register_fleet(topology, fleet, prefill_scale)
        policy = RoutingPolicy.objects.create(
            name="sensitivity", algorithm="gorgo", params={"measured_inputs": measured}, auto_tune=True
        )
        publishing.publish(policy)
        snapshot = publishing.live_version().compiled()
        rq.publish_rtt(client, keys, topology, snapshot.nodes, rtt_scale)
        regions = [r.slug for r in topology.regions]
        gateway_procs, targets = rq.start_gateways(workdir, regions, redis_url, prefix)
        procs += gateway_procs
        duration_s = minutes * 60.0
        plan = build_plan(
            SCENARIO.workload,
            regions,
            rate_rps=rate,
            duration_s=duration_s,
            max_requests=int(rate * duration_s),
            seed=seed,
            max_tokens=rq.MAX_TOKENS,
        )
        tuner = threading.Thread(target=_tuner_loop, args=(policy.pk, stop, errors), daemon=True)
        started_s = time.time()
        tuner.start()
        results = asyncio.run(
            run_plan(plan, targets, stream=True, request_timeout_s=120.0, drain_timeout_s=rq.DRAIN_S)
        )
        stop.set()
        tuner.join(timeout=60.0)
        time.sleep(0.3)  # the gateways flush their request logs every 50 ms
        arms = _arm_p95s(client, keys)
        by_time = time_windows(client, keys, started_s)
        windows = []
        for index, window in enumerate(policy.tuning_windows.order_by("ended_at"), start=1):
            canary = (
                PolicyExperiment.objects.filter(
                    policy=policy, started_at=window.started_at, started_by="online tuner"
                )
                .order_by("-pk")
                .first()
            )
            measured = arms.get(canary.pk, {}) if canary is not None else {}
            ended_after_s = window.ended_at.timestamp() - started_s
            windows.append(
                {
                    "window": index,  # the decision's number (kept name: the JSON's shape)
                    "ended_after_s": round(ended_after_s, 1),
                    "ended_in_window": math.ceil(ended_after_s / TUNER_WINDOW_S),
                    "windows_spanned": max(
                        0,
                        int((window.ended_at - window.started_at).total_seconds() - tuning_settle_s())
                        // int(TUNER_WINDOW_S),
                    ),
                    "trial": [window.w_rtt, window.w_queue],
                    "outcome": window.outcome,
                    "sigma": round(window.sigma, 3),
                    "live_p95_ms": (measured.get("live") or {}).get("p95_ms"),
                    "trial_p95_ms": (measured.get("canary") or {}).get("p95_ms"),
                    "requests": [
                        (measured.get("live") or {}).get("requests"),
                        (measured.get("canary") or {}).get("requests"),
                    ],
                    "note": window.note,
                }
            )
        final = publishing.live_version().compiled().policy.params
        return {
            "variant": variant,
            "measured_inputs": measured,
            "told_prefill_scale": prefill_scale,
            "told_rtt_scale": rtt_scale,
            "seed": seed,
            "minutes": minutes,
            "rate_rps": rate,
            "requests_sent": len(results),
            "errors": sum(1 for r in results if not r.ok),
            "window_s": TUNER_WINDOW_S,
            "min_requests_per_arm": TUNER_MIN_REQUESTS,
            "canary_percent": TUNER_CANARY_PERCENT,
            "ideal_w_rtt": round(1.0 / (prefill_scale * rtt_scale), 3),
            "final_weights": [final.w_rtt, final.w_queue],
            "windows": windows,
            "time_windows": by_time,
            "promotion_rule": promotion_rule(),
            "tuner_errors": errors,
        }
    finally:
        stop.set()
        for proc in reversed(procs):
            proc.stop()
        rq.delete_namespace(client, prefix)
        client.close()


def recovery(tuner: dict[str, Any], correct: dict[str, Any] | None) -> dict[str, Any]:
    """How the live weights served against the run on correct inputs, window by window (same seed,
    so the same traffic at that time: a long geo-chat run gets heavier as conversations grow and
    caches evict, so a reference from another point of the run, or from the short static runs,
    would not compare), and the first window from which they stay within ``RECOVERED_WITHIN``."""
    mine = {w["window"]: w for w in tuner.get("time_windows") or []}
    reference = {w["window"]: w for w in (correct or {}).get("time_windows") or []}
    shared = [
        n
        for n in sorted(mine)
        if n in reference and mine[n]["live_geomean_ms"] and reference[n]["live_geomean_ms"]
    ]
    if correct is None or not shared:
        return {"recovered_at_window": None, "windows": len(mine), "reference": None}
    ratios = [mine[n]["live_geomean_ms"] / reference[n]["live_geomean_ms"] for n in shared]
    # Recovery is the tuner's doing only after it changed the live weights: before its first
    # promotion, a stretch within 10 % is the traffic's or the machine's noise.
    promoted = [w["ended_in_window"] for w in tuner["windows"] if w["outcome"] == "accepted"]
    # With measured inputs the gateways correct the input themselves: recovery is theirs, from the
    # first window on, whatever the tuner did.
    by_measurement = bool(tuner.get("measured_inputs"))
    within = None
    first = None
    for index, window in enumerate(shared):
        # over the rest of the run, weighted by requests: "recovered and stayed recovered"
        rest = shared[index:]
        log_mine = sum(mine[n]["live_requests"] * math.log(mine[n]["live_geomean_ms"]) for n in rest)
        log_ref = sum(reference[n]["live_requests"] * math.log(reference[n]["live_geomean_ms"]) for n in rest)
        mine_n = sum(mine[n]["live_requests"] for n in rest)
        ref_n = sum(reference[n]["live_requests"] for n in rest)
        if math.exp(log_mine / mine_n - log_ref / ref_n) <= RECOVERED_WITHIN:
            within = window if within is None else within
            if by_measurement or (promoted and window >= promoted[0]):
                first = window
                break
    return {
        "recovered_at_window": first,
        "within_from_window": within,  # whether or not the tuner had changed anything by then
        "first_promotion_window": promoted[0] if promoted else None,
        "windows": len(shared),
        "reference": "the live weights of the tuner run on correct inputs, same 10 s window",
        "live_geomean_over_correct": [round(r, 2) for r in ratios],
        "first_6_windows_over_correct": round(
            statistics.median(ratios[:6]), 2
        ),  # before any promotion could act: the harm to recover from
    }


def same_weights_windows(tuner: dict[str, Any]) -> list[dict[str, Any]]:
    """Windows whose trial had the live weights (within 2 %, e.g. both clipped to the box): an A/A
    test of how far two arms' p95s differ by chance in one window."""
    found = []
    live = (1.0, 1.0)
    for w, after in zip(tuner["windows"], incumbents(tuner), strict=True):
        trial = w["trial"]
        if (
            all(abs(t - v) <= 0.02 * v for t, v in zip(trial, live, strict=True))
            and w["live_p95_ms"]
            and w["trial_p95_ms"]
        ):
            found.append(
                {
                    "window": w["window"],
                    "live_p95_ms": w["live_p95_ms"],
                    "trial_p95_ms": w["trial_p95_ms"],
                    "difference": round(abs(w["trial_p95_ms"] / w["live_p95_ms"] - 1), 3),
                }
            )
        live = after
    return found


def incumbents(tuner: dict[str, Any]) -> list[tuple[float, float]]:
    """The live (incumbent) weights after each window: a promoted trial becomes them."""
    current = (1.0, 1.0)  # GorgoParams' defaults: the policy starts with them
    after = []
    for w in tuner["windows"]:
        if w["outcome"] == "accepted":
            current = (w["trial"][0], w["trial"][1])
        after.append(current)
    return after


# ---- outputs -------------------------------------------------------------------------------------


def promotion_rule() -> dict[str, Any]:
    from controlplane.policies import tuner_math

    return {
        "statistic": "mean log TTFT, trial arm - live arm, since the trial started",
        "interval": "always-valid (mSPRT), canary_stats.always_valid_interval",
        "alpha": tuner_math.PROMOTE_ALPHA,
        "tau": tuner_math.PROMOTE_TAU,
        "min_improvement": tuner_math.MIN_IMPROVEMENT,
        "max_windows_per_trial": tuner_math.MAX_WINDOWS_PER_TRIAL,
    }


def tuning_settle_s() -> float:
    from controlplane.policies.tuning import SETTLE_S

    return SETTLE_S


def markdown(document: dict[str, Any]) -> str:
    meta = document["meta"]
    lines = [
        "# Routing sensitivity: gorgo told wrong inputs (issue 24, item 4)",
        "",
        f"`{meta['command']}` on {meta['date']}; {meta['machine']}; load average before/after "
        f"{meta['load_before']} / {meta['load_after']}.",
        "",
    ]
    static = document.get("static")
    if static:
        lines += [
            f"## Wrong inputs, no tuning (geo-chat, {static['rate_rps']:g} requests/s, "
            f"{static['requests_per_run']} measured requests per run after "
            f"{static.get('warmup_requests', round(static['requests_per_run'] * rq.WARMUP_SHARE))} "
            f"warm-up arrivals, seeds {static['seeds']})",
            "",
            "Client-measured TTFT, median over seeds (range); ratio to the correct inputs' median.",
            "",
            "| told | p50 | p90 | p99 | p50 / correct | p99 / correct | cross-region | hit rate |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, row in static["variants"].items():

            def ms(label: str, row: dict[str, Any] = row) -> str:
                value = row[label]
                return f"{value['median']:,.0f} ({value['low']:,.0f}-{value['high']:,.0f}) ms"

            lines.append(
                f"| {name} | {ms('p50')} | {ms('p90')} | {ms('p99')} | {row['p50']['vs_correct']:.2f}x "
                f"| {row['p99']['vs_correct']:.2f}x | {row['cross_region_share']['median']:.0%} "
                f"| {row['prefix_hit_rate']['median']:.0%} |"
            )
        corrected = [(name, row) for name, row in static["variants"].items() if row.get("corrections")]
        if corrected:
            lines += [
                "",
                "When the gateways' decisions stopped using the wrong input (measured inputs on): seconds "
                "from a gateway's first request to the decision from which every later one prices "
                f"prefill (and, for a wrong RTT, its forwards' round trips) within {CORRECTED_WITHIN:.0%} "
                "of the truth; per run, the slowest of its three gateways (- : the input was right from "
                "the start or never used), and the speed in use at the end.",
                "",
                "| told | prefill speed corrected after (s), per seed | RTT corrected after (s), per seed "
                "| ms per token at the end (truth 0.094) |",
                "|---|---|---|---|",
            ]
            for name, row in corrected:
                speed_s, rtt_s, ends = [], [], []
                for run in row["corrections"]:
                    gateways = run["gateways"].values()
                    speed = [g["speed_corrected_after_s"] for g in gateways]
                    rtt = [g["rtt_corrected_after_s"] for g in gateways if g["forwards"]]
                    speed_s.append("never" if None in speed else f"{max(speed):.1f}")
                    rtt_s.append("never" if None in rtt else (f"{max(rtt):.1f}" if rtt else "-"))
                    ends += [g["ms_per_token_at_end"] for g in gateways if g["ms_per_token_at_end"]]
                end = f"{statistics.median(ends):.3f}" if ends else "-"
                lines.append(f"| {name} | {', '.join(speed_s)} | {', '.join(rtt_s)} | {end} |")
    for variant, tuner in (document.get("tuner") or {}).items():
        lines += tuner_markdown(variant, tuner)
    # Runs kept beside the main ones: at a higher rate (an invocation with another --out, merged
    # under this key by hand), and the runs of the rule before a tie widened the step (ties shrank
    # it, as losses do), which showed the need (docs/routing.md, "Online tuning").
    for key, heading_note in (
        ("tuner_measured", ", measured inputs on (the gateways measure RTT and prefill speed)"),
        ("tuner_42rps", " (at 42/s)"),
        ("tuner_ties_shrink", " (earlier: a tie shrank the step)"),
    ):
        for variant, tuner in (document.get(key) or {}).items():
            lines += tuner_markdown(variant, tuner, heading_note)
    for note in meta.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def tuner_markdown(variant: str, tuner: dict[str, Any], heading_note: str = "") -> list[str]:
    rec = tuner.get("recovery") or {}
    rule = tuner.get("promotion_rule")
    lines = [
        "",
        f"## The online tuner on the wall-clock fleet, told {variant}{heading_note}",
        "",
        f"{tuner['minutes']:g} min of geo-chat at {tuner['rate_rps']:g}/s (seed {tuner['seed']}), the "
        f"tuner's real code: windows of {tuner['window_s']:g} s with at least "
        f"{tuner['min_requests_per_arm']} answered requests per arm, each trial a canary on "
        f"{tuner['canary_percent']:g} % of the sessions"
        + (
            f"; a trial is promoted when its geometric-mean TTFT is at least {rule['min_improvement']:.0%} "
            f"below the live arm's with {1 - rule['alpha']:.0%} always-valid confidence, accumulated over "
            f"up to {rule['max_windows_per_trial']} windows"
            if rule
            else "; a trial is promoted when its window p95 beats the live arm's by 2 % (the rule before issue 24)"
        )
        + f". The weights that undo this error: w_rtt = {tuner['ideal_w_rtt']:g} (w_queue 1). Final live "
        f"weights: w_rtt {tuner['final_weights'][0]:g}, w_queue {tuner['final_weights'][1]:g}.",
        "",
        "| decision | ended at | windows | trial w_rtt, w_queue | live arm p95 | trial arm p95 "
        "| requests (live, trial) | decision | live weights after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w, live_weights in zip(tuner["windows"], incumbents(tuner), strict=True):
        live = "-" if w["live_p95_ms"] is None else f"{w['live_p95_ms']:,.0f} ms"
        trial = "-" if w["trial_p95_ms"] is None else f"{w['trial_p95_ms']:,.0f} ms"
        lines.append(
            f"| {w['window']} | {w['ended_after_s']:.0f} s (window {w.get('ended_in_window', '-')}) "
            f"| {w.get('windows_spanned', 1)} | {w['trial'][0]:.3g}, {w['trial'][1]:.3g} "
            f"| {live} | {trial} | {w['requests'][0]}, {w['requests'][1]} | {w['outcome']} "
            f"| {live_weights[0]:.3g}, {live_weights[1]:.3g} |"
        )
    accepted = sum(1 for w in tuner["windows"] if w["outcome"] == "accepted")
    lines += ["", f"Trials promoted: {accepted} of {len(tuner['windows'])} decided."]
    same = same_weights_windows(tuner)
    if same:
        lines.append(
            "Trials with the live weights (an A/A test of the noise): "
            + ", ".join(
                f"decision {w['window']}: {w['live_p95_ms']:,.0f} vs {w['trial_p95_ms']:,.0f} ms "
                f"({w['difference']:.0%} apart)"
                for w in same
            )
            + "."
        )
    ratios = rec.get("live_geomean_over_correct") or []
    if variant != "correct" and ratios:
        ordered = sorted(ratios)
        found = rec["recovered_at_window"]
        lines.append(
            f"Live weights' geometric-mean TTFT over the correct-inputs run's, same 10 s window, "
            f"{len(ratios)} windows: median {ordered[len(ordered) // 2]:.2f}, range "
            f"{ordered[0]:.2f}-{ordered[-1]:.2f}; windows 1-6 (before a promotion could act) "
            f"{rec['first_6_windows_over_correct']:.2f}. "
            + (
                f"Recovered by the gateways' measured inputs: within {RECOVERED_WITHIN - 1:.0%} of it over "
                f"the rest of the run from window {found} on."
                if found is not None and tuner.get("measured_inputs")
                else f"Recovered: within {RECOVERED_WITHIN - 1:.0%} of it over the rest of the run from window "
                f"{found} on (first promotion in window {rec['first_promotion_window']})."
                if found is not None
                else f"Nothing to recover at this rate: the starting weights serve within "
                f"{RECOVERED_WITHIN - 1:.0%} of the correct inputs' over the run from window 1 on."
                if rec.get("within_from_window") == 1
                else "Not recovered: "
                + (
                    "the tuner promoted nothing"
                    if rec.get("first_promotion_window") is None
                    else f"after its first promotion (window {rec['first_promotion_window']}) the live "
                    f"weights never stayed within {RECOVERED_WITHIN - 1:.0%}"
                )
                + (
                    f"; the ratio over the rest of the run is within {RECOVERED_WITHIN - 1:.0%} from "
                    f"window {rec['within_from_window']} on all the same (noise and drift, not the tuner)."
                    if rec.get("within_from_window") is not None and found is None
                    else "."
                )
            )
        )
    if tuner["tuner_errors"]:
        lines += ["", f"Tuner errors: {tuner['tuner_errors']}"]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part",
        choices=("static", "tuner", "report"),
        default="static",
        help="report: rewrite the markdown from the JSON at --out",
    )
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--requests", type=int, default=rq.REQUESTS_PER_RUN)
    parser.add_argument(
        "--tuner-variant",
        default="prefill x2",
        choices=list(VARIANTS),
        help="one per invocation; run 'correct' too (the reference), results merge into --out",
    )
    parser.add_argument(
        "--measured",
        default=",".join(MEASURED_MODES),
        help="static part: the gateways on the told values only (told), on what they measure "
        "(measured, the default policy), or both side by side",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="static part: which inputs (correct always runs: each mode's reference)",
    )
    parser.add_argument(
        "--warmup-requests",
        type=int,
        help="static part: arrivals before the measured ones (default: 10 %% of --requests); a longer "
        "warm-up measures the steady state after the gateways measured their inputs",
    )
    parser.add_argument("--tuner-minutes", type=float, default=6.0)
    parser.add_argument("--tuner-seed", type=int, default=1)
    parser.add_argument("--tuner-rate", type=float, default=TUNER_RATE_RPS, help="requests/s of a tuner run")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    exit_on_sigterm()  # a kill stops what this started
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    redis.Redis.from_url(redis_url).ping()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="gorgo-sens-"))
    load_before = [round(v, 2) for v in os.getloadavg()]
    started_s = time.perf_counter()
    out = Path(args.out)
    document: dict[str, Any] = {}
    notes: list[str] = []
    if out.with_suffix(".json").exists():
        # One invocation per part or tuner variant (Django is set up once per process): keep what
        # the earlier ones measured.
        previous = json.loads(out.with_suffix(".json").read_text())
        document = {name: value for name, value in previous.items() if name != "meta"}
        notes = previous.get("meta", {}).get("notes", [])
        notes.append(f"earlier: `{previous['meta']['command']}` (load {previous['meta']['load_before']})")
    if args.part == "report":
        document = json.loads(out.with_suffix(".json").read_text())
        out.with_suffix(".md").write_text(markdown(document))
        return 0
    if args.part == "static":
        modes = tuple(mode for mode in args.measured.split(",") if mode)
        if not modes or set(modes) - set(MEASURED_MODES):
            parser.error(f"--measured: choose from {', '.join(MEASURED_MODES)}")
        chosen = {name for name in args.variants.split(",") if name} | {"correct"}
        if chosen - set(VARIANTS):
            parser.error(f"--variants: choose from {', '.join(VARIANTS)}")
        document["static"] = run_static(
            seeds, args.requests, redis_url, workdir, modes, chosen, args.warmup_requests
        )
    if args.part == "tuner":
        if "," in args.measured:
            args.measured = "measured"  # the default policy's; --measured told: the tuner alone
        if args.measured not in MEASURED_MODES:
            parser.error(f"--measured for the tuner part: one of {', '.join(MEASURED_MODES)}")
        measured = args.measured == "measured"
        # told: the runs of the tuner alone (gorgo before measured inputs); measured: beside them
        tuners = document.setdefault("tuner_measured" if measured else "tuner", {})
        tuners[args.tuner_variant] = run_tuner(
            args.tuner_variant,
            args.tuner_minutes,
            args.tuner_seed,
            args.tuner_rate,
            redis_url,
            workdir,
            measured,
        )
        for variant, tuner in tuners.items():
            if variant != "correct":
                tuner["recovery"] = recovery(tuner, tuners.get("correct"))
    document["meta"] = {
        "command": "python benchmarks/routing_sensitivity.py"
        + (" " + " ".join(argv or sys.argv[1:])).rstrip(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.platform()}, Python {platform.python_version()}, {os.cpu_count()} CPUs",
        "duration_s": round(time.perf_counter() - started_s, 1),
        "load_before": load_before,
        "load_after": [round(v, 2) for v in os.getloadavg()],
        "variants": {
            name: {"told_prefill_scale": p, "told_rtt_scale": r} for name, (p, r) in VARIANTS.items()
        },
        "notes": notes,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(document, indent=1, default=float) + "\n")
    out.with_suffix(".md").write_text(markdown(document))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}", flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
