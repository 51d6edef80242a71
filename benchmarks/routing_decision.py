"""Routing decision latency: hash the prompt, match the prefix index, choose a node. In-process.

    python benchmarks/routing_decision.py            # from the repo root; ~20 s, bounded

One decision is what the gateway does on the request path before it forwards: chained chunk
hashes of the rendered prompt, ``match_hashes`` over the candidates, building the ``RoutingView``
and the algorithm's ``choose``. Measured for ``gorgo`` and ``prefix_affinity`` with a
32,000-character prompt and 64 candidate nodes whose index holds 200 earlier prompts each
(system prompts of 2k-8k tokens plus conversation histories), in three cases:

- ``cold``: the prompt shares nothing with the index (the bisection stops at chunk 0);
- ``shared-system``: its 8k-token system prompt is on a third of the nodes, its conversation
  history on one;
- ``all-nodes-distinct``: every node holds a different length of it (worst case: one bisection
  per node).

Also reported: the cost of the index insertion after the decision (on the request path, not in
the decision), and the hash-function/chunk-size comparison behind ``CHUNK_BYTES`` and xxh3.
Writes benchmarks/results/routing_decision.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import random
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PROMPT_CHARS = 32_000
NODES = 64
REGIONS = ("us-east", "eu-central", "ap-south")
RTT_MS = {"us-east": 1.5, "eu-central": 88.0, "ap-south": 235.0}  # from us-east, default topology
TARGET_P99_US = 200.0


def words(rng: random.Random, chars: int) -> str:
    vocabulary = ["the", "cache", "prefill", "token", "region", "node", "latency", "route", "model", "a"]
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(vocabulary)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    count = len(ordered)
    return {
        "p50_us": round(ordered[count // 2] / 1000, 1),
        "p99_us": round(ordered[min(count - 1, int(count * 0.99))] / 1000, 1),
        "max_us": round(ordered[-1] / 1000, 1),
        "samples": count,
    }


def timed(fn: Callable[[int], object], iterations: int) -> list[int]:
    for warmup in range(min(200, iterations)):
        fn(warmup)
    samples: list[int] = []
    clock = time.perf_counter_ns
    for iteration in range(iterations):
        start = clock()
        fn(iteration)
        samples.append(clock() - start)
    return samples


def build_fleet(rng: random.Random) -> dict[str, Any]:
    from routing.algorithms.base import NodeLoad
    from routing.contract import NodeSpec
    from routing.prefix_index import ApproxPrefixIndex

    nodes = tuple(
        NodeSpec(
            id=node_id,
            name=f"node-{node_id}",
            region=REGIONS[node_id % 3],
            base_url=f"http://127.0.0.1:{8100 + node_id}",
            models=("m",),
            gpu_type="H100-80GB",
            gpu_count=1,
            max_num_seqs=1024,
            prefill_tokens_per_s=20_000.0,
            kv_capacity_tokens=448_000,
            state="active",
        )
        for node_id in range(1, NODES + 1)
    )
    index = ApproxPrefixIndex(chars_per_token=4.0)
    index.sync_nodes(nodes)
    now_s = time.time()
    systems = [words(rng, rng.randint(8_000, 32_000)) for _ in range(8)]
    for node in nodes:
        for _ in range(200):
            history = rng.choice(systems) + words(rng, rng.randint(500, 24_000))
            index.insert_hashes(node.id, index.chunk_hashes(history), now_s)
    load = {node.id: NodeLoad(rng.randint(0, 40), rng.randint(0, 30_000)) for node in nodes}
    rtt_ms = {node.id: RTT_MS[node.region] + rng.random() for node in nodes}

    system = words(rng, 32_000)[: 8_000 * 4]  # 8k tokens
    conversation = (system + words(rng, PROMPT_CHARS))[:PROMPT_CHARS]
    cold = words(random.Random(99), PROMPT_CHARS)
    hashes = index.chunk_hashes(conversation)
    system_hashes = index.chunk_hashes(system)
    for node in nodes[: NODES // 3]:
        index.insert_hashes(node.id, system_hashes, now_s)
    index.insert_hashes(nodes[0].id, hashes[: len(hashes) * 3 // 4], now_s)

    distinct = ApproxPrefixIndex(chars_per_token=4.0)
    distinct.sync_nodes(nodes)
    for position, node in enumerate(nodes):
        distinct.insert_hashes(node.id, hashes[: 1 + position * (len(hashes) - 1) // NODES], now_s)

    return {
        "nodes": nodes,
        "load": load,
        "rtt_ms": rtt_ms,
        "now_s": now_s,
        "cases": {
            "cold": (index, cold),
            "shared-system": (index, conversation),
            "all-nodes-distinct": (distinct, conversation),
        },
    }


def measure_decisions(fleet: dict[str, Any], iterations: int) -> dict[str, Any]:
    from routing.algorithms import gorgo, prefix_affinity
    from routing.algorithms.base import RoutingRequest, RoutingView
    from routing.contract import GorgoParams, PrefixAffinityParams

    nodes = fleet["nodes"]
    node_ids = [node.id for node in nodes]
    algorithms = {
        "gorgo": (gorgo.choose, GorgoParams()),
        "prefix_affinity": (prefix_affinity.choose, PrefixAffinityParams()),
    }
    now_s = fleet["now_s"]
    results: dict[str, Any] = {}
    for name, (choose, params) in algorithms.items():
        results[name] = {}
        for case, (index, prompt) in fleet["cases"].items():
            request = RoutingRequest("m", len(prompt), int(len(prompt) / 4 + 0.5))

            def decide(
                sequence: int, index=index, prompt=prompt, request=request, choose=choose, params=params
            ):
                hashes = index.chunk_hashes(prompt)
                matched = index.match_hashes(hashes, node_ids, now_s)
                view = RoutingView(
                    "us-east", nodes, params, fleet["load"], fleet["rtt_ms"], {}, matched, sequence, "bench"
                )
                return choose(view, request)

            results[name][case] = percentiles(timed(decide, iterations))
            results[name][case]["matched_nodes"] = len(
                index.match_hashes(index.chunk_hashes(prompt), node_ids, now_s)
            )
    return results


def measure_parts(fleet: dict[str, Any], iterations: int) -> dict[str, Any]:
    from routing.algorithms import gorgo
    from routing.algorithms.base import RoutingRequest, RoutingView
    from routing.contract import GorgoParams

    index, prompt = fleet["cases"]["shared-system"]
    nodes = fleet["nodes"]
    node_ids = [node.id for node in nodes]
    now_s = fleet["now_s"]
    hashes = index.chunk_hashes(prompt)
    matched = index.match_hashes(hashes, node_ids, now_s)
    request = RoutingRequest("m", len(prompt), len(prompt) // 4)
    params = GorgoParams()

    def choose(sequence: int) -> object:
        view = RoutingView(
            "us-east", nodes, params, fleet["load"], fleet["rtt_ms"], {}, matched, sequence, "b"
        )
        return gorgo.choose(view, request)

    return {
        "hash_32k_chars": percentiles(timed(lambda _: index.chunk_hashes(prompt), iterations)),
        "match_64_nodes": percentiles(
            timed(lambda _: index.match_hashes(hashes, node_ids, now_s), iterations)
        ),
        "gorgo_choose_64_nodes": percentiles(timed(choose, iterations)),
        "insert_after_decision": percentiles(
            timed(lambda i: index.insert_hashes(node_ids[i % NODES], hashes, now_s), iterations)
        ),
    }


def hash_comparison(iterations: int) -> dict[str, Any]:
    """Chained hashing of a 32k-character prompt per chunk size and hash function."""
    import xxhash

    data = words(random.Random(5), PROMPT_CHARS).encode()
    view = memoryview(data)

    def crc32(size: int) -> list[int]:
        out, parent = [], 0
        for start in range(0, len(data) - size + 1, size):
            parent = zlib.crc32(view[start : start + size], parent)
            out.append(parent)
        return out

    def blake2b(size: int) -> list[int]:
        out, state = [], hashlib.blake2b(digest_size=8)
        for start in range(0, len(data) - size + 1, size):
            state.update(view[start : start + size])
            out.append(int.from_bytes(state.copy().digest(), "little"))
        return out

    def xxh3(size: int) -> list[int]:
        out, parent = [], 0
        for start in range(0, len(data) - size + 1, size):
            parent = xxhash.xxh3_64_intdigest(view[start : start + size], parent)
            out.append(parent)
        return out

    table: dict[str, Any] = {}
    for size in (64, 128, 256, 512):
        for name, fn, bits in (("crc32", crc32, 32), ("blake2b-64", blake2b, 64), ("xxh3-64", xxh3, 64)):
            row = percentiles(timed(lambda _, fn=fn, size=size: fn(size), iterations))
            row["bits"] = bits
            table[f"{name}/{size}"] = row
    return table


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Routing decision latency",
        "",
        f"`python benchmarks/routing_decision.py` on {report['machine']['platform']}, "
        f"Python {report['machine']['python']}, {report['machine']['cpus']} CPUs; "
        f"{report['prompt_chars']:,}-character prompt, {report['nodes']} candidate nodes, "
        f"{report['iterations']:,} decisions per row. One decision = chunk hashes + prefix-index "
        f"match + RoutingView + choose. Target: p99 < {TARGET_P99_US:.0f} us.",
        "",
        "| algorithm | case | nodes matched | p50 us | p99 us | max us |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for algorithm, cases in report["decision"].items():
        for case, row in cases.items():
            lines.append(
                f"| {algorithm} | {case} | {row['matched_nodes']} | {row['p50_us']} | {row['p99_us']} | {row['max_us']} |"
            )
    lines += ["", "Parts (gorgo, shared-system case):", "", "| part | p50 us | p99 us |", "|---|---:|---:|"]
    for part, row in report["parts"].items():
        lines.append(f"| {part} | {row['p50_us']} | {row['p99_us']} |")
    lines += [
        "",
        "Chained hashing of the 32k-character prompt, by function and chunk size (bytes):",
        "",
        "| hash / chunk | bits | p50 us | p99 us |",
        "|---|---:|---:|---:|",
    ]
    for name, row in report["hash_comparison"].items():
        lines.append(f"| {name} | {row['bits']} | {row['p50_us']} | {row['p99_us']} |")
    lines += ["", f"Worst p99 over all decision rows: {report['worst_decision_p99_us']} us.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=5_000, help="decisions per row (bounded)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args()
    iterations = max(100, min(args.iterations, 50_000))
    sys.path.insert(0, str(ROOT))

    rng = random.Random(2024)
    started = time.perf_counter()
    fleet = build_fleet(rng)
    gc.collect()
    report: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "prompt_chars": PROMPT_CHARS,
        "nodes": NODES,
        "iterations": iterations,
        "decision": measure_decisions(fleet, iterations),
        "parts": measure_parts(fleet, iterations),
        "hash_comparison": hash_comparison(max(100, iterations // 5)),
    }
    report["worst_decision_p99_us"] = max(
        row["p99_us"] for cases in report["decision"].values() for row in cases.values()
    )
    report["target_p99_us"] = TARGET_P99_US
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing_decision.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "routing_decision.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
