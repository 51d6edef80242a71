"""Demo-like telemetry history and live state for the browser tests, written as the workers would.

Run inside the control plane's environment (its database and Redis prefix):

    DATABASE_URL=... GORGO_REDIS_PREFIX=... python -m tests.browser.demo_data [--minutes 20]

The numbers follow the demo topology (docs/simulator.md): RTTs of the emulated WAN, slower TTFT
for clients far from their cache, hit rates that climb as conversations repeat. Seeded, so every
run draws the same charts.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime

# RTT between region hubs (ms), as in simulator/topologies/default.toml.
LINK_RTT_MS = {
    frozenset({"us-east", "eu-central"}): 88.0,
    frozenset({"us-east", "ap-south"}): 235.0,
    frozenset({"eu-central", "ap-south"}): 120.0,
}
INTRA_REGION_RTT_MS = 1.5


@dataclass(frozen=True, slots=True)
class Row:
    """One emulated request: where it went, its TTFT and parts (ms), tokens (prompt, expected, hit)."""

    node_id: int
    ttft_ms: float
    parts_ms: tuple[float, float, float, float]
    tokens: tuple[int, int, int]


def rtt_ms(a: str, b: str) -> float:
    return INTRA_REGION_RTT_MS if a == b else LINK_RTT_MS.get(frozenset({a, b}), 150.0)


def seed(minutes: int = 20, now_s: float | None = None) -> dict[str, int]:
    """Write ``minutes`` of history and the current live state; returns row counts."""
    from controlplane.connections import redis_client, redis_keys
    from controlplane.fleet.models import Node, Region
    from controlplane.histogram import error_bin
    from routing import contract
    from routing.contract import NodeLiveState, RTTEntry, RTTTable
    from telemetry.aggregation import histogram_quantile_ms, ttft_bin
    from telemetry.choices import HealthChoices
    from telemetry.models import MetricSample, NodeHealth, RequestAggregate

    rng = random.Random(7)
    now_s = time.time() if now_s is None else now_s
    regions = list(Region.objects.order_by("slug"))
    nodes = list(Node.objects.select_related("region").order_by("pk"))
    home = {r.slug: [n for n in nodes if n.region_id == r.pk] for r in regions}
    aggregates: list[RequestAggregate] = []

    def draw(client_region: str) -> Row:
        # Most requests stay in their region; some follow a cached prefix abroad.
        node = rng.choice(home[client_region] if rng.random() < 0.8 else nodes)
        network = rtt_ms(client_region, node.region.slug) * rng.uniform(0.95, 1.08)
        queue = rng.expovariate(1 / 12.0)
        prompt = rng.randint(1500, 6000)
        hit = min(0.97, max(0.0, rng.gauss(0.72 if client_region == node.region.slug else 0.55, 0.12)))
        prefill = prompt * (1 - hit) / 20.0  # 20k prompt tokens/s
        parts = (rng.uniform(0.15, 0.4), network, queue, prefill)
        return Row(
            node.pk,
            sum(parts) + rng.uniform(4.0, 9.0),
            parts,
            (prompt, int(prompt * min(0.99, hit + 0.05)), int(prompt * hit)),
        )

    def bucket(resolution: str, start_s: float, rows: list[Row], **target) -> None:
        histogram: dict[str, int] = {}
        for row in rows:
            histogram[str(ttft_bin(row.ttft_ms))] = histogram.get(str(ttft_bin(row.ttft_ms)), 0) + 1
        sums = [sum(row.parts_ms[i] for row in rows) for i in range(4)]
        # What the router predicted: the network and gateway right, queue and prefill roughly.
        prediction_errors = [
            row.ttft_ms
            - (
                row.parts_ms[0]
                + row.parts_ms[1]
                + row.parts_ms[2] * rng.uniform(0.5, 1.2)
                + row.parts_ms[3] * rng.uniform(0.8, 1.1)
            )
            for row in rows
        ]
        error_histogram: dict[str, int] = {}
        for error in prediction_errors:
            error_histogram[error_bin(error)] = error_histogram.get(error_bin(error), 0) + 1
        errors = sum(1 for _ in rows if rng.random() < 0.01)
        aggregates.append(
            RequestAggregate(
                resolution=resolution,
                scope="region" if "region" in target else "node",
                bucket_start=datetime.fromtimestamp(start_s, tz=UTC),
                count=len(rows),
                errors=errors,
                ttft_count=len(rows),
                ttft_sum_ms=sum(row.ttft_ms for row in rows),
                ttft_histogram=histogram,
                ttft_p50_ms=histogram_quantile_ms(histogram, 0.5),
                ttft_p90_ms=histogram_quantile_ms(histogram, 0.9),
                ttft_p99_ms=histogram_quantile_ms(histogram, 0.99),
                gateway_sum_ms=sums[0],
                network_sum_ms=sums[1],
                network_count=len(rows),
                queue_sum_ms=sums[2],
                prefill_sum_ms=sums[3],
                node_stats_count=len(rows),
                prompt_tokens=sum(row.tokens[0] for row in rows),
                predicted_cached_tokens=sum(row.tokens[1] for row in rows),
                cached_tokens=sum(row.tokens[2] for row in rows),
                prediction_count=len(rows),
                prediction_error_sum_ms=sum(prediction_errors),
                prediction_abs_error_sum_ms=sum(abs(e) for e in prediction_errors),
                prediction_error_histogram=error_histogram,
                **target,
            )
        )

    first_s = int((now_s - minutes * 60) // 60 * 60)
    minute: dict[tuple[str, object], list[Row]] = {}
    for ten in range(first_s, int(now_s), 10):
        per_node: dict[int, list[Row]] = {n.pk: [] for n in nodes}
        for region in regions:
            load = 0.6 + 0.4 * math.sin(ten / 300.0 + region.pk)
            rows = [draw(region.slug) for _ in range(max(0, int(rng.gauss(18 * load, 3))))]
            bucket("10s", ten, rows, region=region)
            minute.setdefault(("region", region), []).extend(rows)
            for row in rows:
                per_node[row.node_id].append(row)
        for node in nodes:
            bucket("10s", ten, per_node[node.pk], node=node)
            minute.setdefault(("node", node), []).extend(per_node[node.pk])
        if (ten + 10) % 60 == 0 or ten + 10 >= now_s:
            for (scope, target), rows in minute.items():
                bucket("1m", ten // 60 * 60, rows, **{scope: target})
            minute = {}
    RequestAggregate.objects.bulk_create(aggregates, ignore_conflicts=True)

    samples, last_sample = [], {}
    for node in nodes:
        kv = rng.uniform(0.1, 0.3)
        for k, ts in enumerate(range(int(now_s - minutes * 60), int(now_s), 5)):
            kv = min(0.95, max(0.02, kv + rng.gauss(0.004, 0.02)))
            queries = rng.uniform(20_000, 60_000)
            hit = min(0.98, 0.35 + 0.5 * (1 - math.exp(-k / 60)) + rng.gauss(0, 0.04))
            samples.append(
                MetricSample(
                    node=node,
                    ts=datetime.fromtimestamp(ts, tz=UTC),
                    ok=True,
                    interval_s=5.0,
                    num_running=rng.randint(0, 12),
                    num_waiting=rng.randint(0, 3),
                    kv_cache_usage=kv,
                    prefix_queries_tokens=queries,
                    prefix_hits_tokens=queries * max(0.0, hit),
                    prefix_hit_rate=max(0.0, hit),
                    queue_mean_ms=rng.uniform(3, 20),
                    prefill_mean_ms=rng.uniform(40, 140),
                )
            )
            last_sample[node.pk] = samples[-1]
    MetricSample.objects.bulk_create(samples)

    client, keys = redis_client(), redis_keys()
    for node in nodes:
        NodeHealth.objects.update_or_create(node=node, defaults={"health": HealthChoices.HEALTHY})
        last = last_sample[node.pk]
        state = NodeLiveState(
            schema_version=contract.SCHEMA_VERSION,
            node_id=node.pk,
            healthy=True,
            updated_at=now_s,
            num_running=last.num_running,
            num_waiting=last.num_waiting,
            kv_cache_usage=last.kv_cache_usage,
            prefix_hit_rate=last.prefix_hit_rate,
            last_scrape_at=now_s - 2,
            last_probe_at=now_s - 1,
        )
        client.hset(keys.live_nodes, str(node.pk), contract.encode(state))
    entries = tuple(
        RTTEntry(
            region=r.slug,
            node_id=n.pk,
            rtt_ms=round(rtt_ms(r.slug, n.region.slug) * rng.uniform(0.98, 1.04), 2),
            jitter_ms=round(rng.uniform(0.2, 4.0), 2),
            samples=240,
            updated_at=now_s,
        )
        for r in regions
        for n in nodes
    )
    client.set(
        keys.live_rtt,
        contract.encode(RTTTable(schema_version=contract.SCHEMA_VERSION, updated_at=now_s, entries=entries)),
    )
    return {"aggregates": len(aggregates), "samples": len(samples), "rtt": len(entries)}


def log_requests(count: int, minutes: int = 5, now_s: float | None = None) -> int:
    """Append ``count`` request records over the last ``minutes`` to the request log, as gateways do
    (what the what-if replays): mostly local nodes, regional system prompts as prefix hashes."""
    from controlplane.connections import redis_client, redis_keys
    from controlplane.fleet.models import Node
    from routing import contract
    from routing.contract import CostTerms, RequestRecord

    rng = random.Random(11)
    now_s = time.time() if now_s is None else now_s
    nodes = list(Node.objects.select_related("region").order_by("pk"))
    regions = sorted({n.region.slug for n in nodes})
    client, key = redis_client(), redis_keys().request_stream
    start_s = now_s - minutes * 60
    for index in range(count):
        region = regions[index % len(regions)]
        local = [n for n in nodes if n.region.slug == region]
        node = rng.choice(local if rng.random() < 0.9 else nodes)
        at_s = start_s + (now_s - start_s) * index / count
        prompt = rng.randint(1500, 6000)
        system = [hash((region, rng.randrange(3), chunk)) & (2**63 - 1) for chunk in range(20)]
        own = [rng.getrandbits(63) for _ in range(prompt // 64 - 20)]
        network = rtt_ms(region, node.region.slug)
        ttft = network + rng.uniform(20.0, 120.0)
        record = RequestRecord(
            schema_version=contract.SCHEMA_VERSION,
            request_id=f"demo-{index}",
            ts=at_s,
            gateway_region=region,
            gateway_id=f"demo-{region}",
            model=node.served_models.first().name,
            status=200,
            stream=True,
            node_id=node.pk,
            node_region=node.region.slug,
            algorithm="gorgo",
            prompt_chars=prompt * 4,
            prompt_tokens_est=prompt,
            prompt_tokens=prompt,
            completion_tokens=rng.randint(32, 128),
            gateway_ms=0.4,
            ttft_ms=ttft,
            cost=CostTerms(node.pk, total_ms=ttft * rng.uniform(0.8, 1.1), rtt_ms=network),
            prefix_hashes=tuple(system + own),
        )
        client.xadd(
            key, {contract.REQUEST_STREAM_FIELD: contract.encode(record)}, id=f"{int(at_s * 1000)}-{index}"
        )
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=20)
    parser.add_argument("--requests", type=int, default=0, help="also log this many request records")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    print(seed(args.minutes))
    if args.requests:
        print({"requests": log_requests(args.requests)})


if __name__ == "__main__":
    main()
