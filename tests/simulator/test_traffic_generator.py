"""The traffic generator: seeded plans, bounded runs, per-request measurements and the CLI."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections import Counter
from pathlib import Path

from simulator.tokenizer import count_tokens
from simulator.traffic import build_plan, format_summary, percentile, run_plan, summarize
from simulator.traffic.workloads import MIXED_OUTPUT_TOKENS, MIXED_PROMPT_TOKENS, Arrival, WorkloadPlan
from tests.conftest import ROOT
from tests.simulator.conftest import FleetFactory

REGIONS = ["near", "far"]
LONG_CONTEXT = {"max_model_len": 32768, "kv_capacity_blocks": 8192, "max_num_batched_tokens": 8192}


def test_it_builds_the_same_arrivals_for_the_same_seed() -> None:
    a = build_plan("geo-chat", REGIONS, rate_rps=5, duration_s=60, max_requests=200, seed=3)
    b = build_plan("geo-chat", REGIONS, rate_rps=5, duration_s=60, max_requests=200, seed=3)
    c = build_plan("geo-chat", REGIONS, rate_rps=5, duration_s=60, max_requests=200, seed=4)
    assert a == b
    assert a.arrivals != c.arrivals


def test_it_bounds_a_plan_in_time_and_count() -> None:
    plan = build_plan("no-share", REGIONS, rate_rps=50, duration_s=2, max_requests=1000, seed=1)
    assert 50 <= len(plan.arrivals) <= 200
    assert all(0 < a.at_s < 2 for a in plan.arrivals)
    capped = build_plan("no-share", REGIONS, rate_rps=50, duration_s=60, max_requests=7, seed=1)
    assert len(capped.arrivals) == 7


def test_it_shapes_geo_chat_as_regional_multi_turn_conversations_over_long_system_prompts() -> None:
    plan = build_plan(
        "geo-chat",
        ["us-east", "eu-central", "ap-south"],
        rate_rps=3,
        duration_s=600,
        max_requests=2000,
        seed=1,
    )
    sizes = [count_tokens(p) for p in plan.system_prompts]
    assert min(sizes) >= 2000
    assert max(sizes) <= 8200
    assert {a.client_region for a in plan.arrivals} == {"us-east", "eu-central", "ap-south"}
    assert max(a.turn for a in plan.arrivals) >= 3
    for index, region in enumerate(plan.regions):
        firsts = Counter(a.system_prompt for a in plan.arrivals if a.client_region == region and a.turn == 0)
        preferred = firsts[(2 * index) % 6] + firsts[(2 * index + 1) % 6]
        assert preferred / sum(firsts.values()) >= 0.7, (region, firsts)
    turns: dict[str, list[int]] = {}
    for arrival in plan.arrivals:
        turns.setdefault(arrival.conversation_id, []).append(arrival.turn)
    assert all(t == list(range(len(t))) for t in turns.values())


def test_it_shares_one_system_prompt_in_hot_prefix() -> None:
    plan = build_plan("hot-prefix", REGIONS, rate_rps=10, duration_s=60, max_requests=400, seed=2)
    shared = sum(1 for a in plan.arrivals if a.system_prompt == 0) / len(plan.arrivals)
    assert 0.9 <= shared < 1.0
    assert len(plan.system_prompts) == 1


async def test_it_measures_each_request_against_regional_targets(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet(only=["node-a", "node-b"], **LONG_CONTEXT)
    plan = build_plan(
        "hot-prefix", REGIONS, rate_rps=40, duration_s=1.0, max_requests=30, seed=5, max_tokens=4
    )
    targets = {"near": fleet.url("node-a"), "far": fleet.url("node-b") + "/v1"}
    results = await asyncio.wait_for(run_plan(plan, targets), timeout=60)

    assert len(results) == len(plan.arrivals)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert {r.node for r in results if r.client_region == "near"} == {"node-a"}
    assert {r.node for r in results if r.client_region == "far"} == {"node-b"}
    assert all(r.ttft_ms is not None and r.total_ms is not None and r.ttft_ms <= r.total_ms for r in results)
    assert all(r.completion_tokens == 4 for r in results)
    assert sum(1 for r in results if (r.cached_tokens or 0) > 4000) >= len(results) // 2
    summary = {s.region: s for s in summarize(results)}
    assert summary["near"].requests + summary["far"].requests == len(results)
    assert summary["near"].ttft_p50_ms is not None
    assert "ttft p50 ms" in format_summary(list(summary.values()))


async def test_it_sends_each_turn_after_the_previous_answer_with_the_whole_conversation(
    make_fleet: FleetFactory,
) -> None:
    fleet = await make_fleet(**LONG_CONTEXT)
    arrivals = tuple(
        Arrival(
            index=i,
            at_s=0.01 * i,  # planned faster than answers come: turns must still wait
            client_region="near",
            conversation_id="c1",
            turn=i,
            user="u1",
            user_text=f"Question {i} about the policy manual, please answer it.",
            system_prompt=0,
            max_tokens=8,
        )
        for i in range(3)
    )
    plan = WorkloadPlan(
        workload="geo-chat",
        seed=0,
        rate_rps=1.0,
        duration_s=1.0,
        regions=("near",),
        system_prompts=("You answer questions. " * 100,),
        arrivals=arrivals,
    )
    results = sorted(await run_plan(plan, {"near": fleet.url("node-a")}), key=lambda r: r.turn)
    assert all(r.ok for r in results)
    for earlier, later in itertools.pairwise(results):
        assert later.sent_s is not None and earlier.sent_s is not None
        assert later.sent_s >= earlier.sent_s + earlier.total_ms / 1000.0 * 0.9
        assert later.prompt_tokens > earlier.prompt_tokens + earlier.completion_tokens
        # The previous prompt and most of the previous answer are cached on the node.
        assert later.cached_tokens >= earlier.prompt_tokens - 16


async def test_it_runs_from_the_command_line_and_writes_json_lines(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    fleet = await make_fleet(only=["node-a", "node-b"], **LONG_CONTEXT)
    out = tmp_path / "results.jsonl"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "simulator.traffic",
        "--workload",
        "no-share",
        "--target",
        f"near={fleet.url('node-a')}",
        "--target",
        f"far={fleet.url('node-b')}",
        "--rate",
        "20",
        "--duration",
        "1",
        "--max-requests",
        "8",
        "--max-tokens",
        "3",
        "--seed",
        "9",
        "--out",
        str(out),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    stdout, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    text = stdout.decode()
    assert process.returncode == 0, text
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 8
    assert all(line["status"] == 200 and line["ttft_ms"] > 0 for line in lines)
    assert "ttft p50 ms" in text
    assert "near" in text and "far" in text


def test_it_interpolates_percentiles() -> None:
    assert percentile([], 50) is None
    assert percentile([10.0], 99) == 10.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 90) == 90.0


def test_it_plans_mixed_lengths_with_long_answers() -> None:
    plan = build_plan("mixed-length", REGIONS, rate_rps=10, duration_s=60, max_requests=300, seed=5)
    prompt_tokens = [count_tokens(a.user_text) for a in plan.arrivals]
    low, high = MIXED_PROMPT_TOKENS
    assert min(prompt_tokens) >= low and max(prompt_tokens) <= high + 8
    # log-uniform: most prompts short, some near the top
    assert sorted(prompt_tokens)[len(prompt_tokens) // 2] < 1500
    assert max(prompt_tokens) > 5000
    assert all(a.min_tokens == a.max_tokens >= MIXED_OUTPUT_TOKENS[0] for a in plan.arrivals)
    assert len({a.user_text[:40] for a in plan.arrivals}) == len(plan.arrivals)  # nothing shared


async def test_it_asks_for_the_planned_answer_length_with_min_tokens(make_fleet: FleetFactory) -> None:
    # The emulated model ends an answer on its own within 384 tokens; min_tokens holds it to 400.
    fleet = await make_fleet(only=["node-a"], decode_step_base_ms=0.2, decode_per_seq_ms=0.0)
    arrival = Arrival(
        index=0,
        at_s=0.0,
        client_region="near",
        conversation_id="near-m0",
        turn=0,
        user="near-user1",
        user_text="Request 0: a long answer, please.",
        system_prompt=None,
        max_tokens=400,
        min_tokens=400,
    )
    plan = WorkloadPlan("mixed-length", 1, 1.0, 1.0, ("near",), (), (arrival,))
    (result,) = await asyncio.wait_for(run_plan(plan, {"near": fleet.url("node-a")}), timeout=60)
    assert result.ok and result.completion_tokens == 400


async def test_it_stops_reading_answers_once_every_request_has_its_first_token(
    make_fleet: FleetFactory,
) -> None:
    fleet = await make_fleet(**LONG_CONTEXT)
    # Two single requests with answers of 3,000 tokens (~20 s of decode steps) and a conversation
    # whose second turn can only leave once its first answer (8 tokens) has ended.
    arrivals = (
        *(
            Arrival(
                index=i,
                at_s=0.0,
                client_region="near",
                conversation_id=f"long-{i}",
                turn=0,
                user="near-user1",
                user_text=f"Request {i}: a long answer, please.",
                system_prompt=None,
                max_tokens=3000,
                min_tokens=3000,
            )
            for i in range(2)
        ),
        *(
            Arrival(
                index=2 + turn,
                at_s=0.0,
                client_region="near",
                conversation_id="chat",
                turn=turn,
                user="near-user2",
                user_text=f"Question {turn}: a short answer, please.",
                system_prompt=None,
                max_tokens=8,
                min_tokens=8,
            )
            for turn in range(2)
        ),
    )
    plan = WorkloadPlan("mixed-length", 1, 1.0, 1.0, ("near",), (), arrivals)
    results = await asyncio.wait_for(
        run_plan(plan, {"near": fleet.url("node-a")}, until_first_tokens=True), timeout=15
    )
    by_index = {r.index: r for r in results}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert all(r.ok and r.ttft_ms is not None for r in results), [r.error for r in results]
    for long in (by_index[0], by_index[1]):  # cut after the first token: not an error, no end
        assert long.cut_after_first_token and long.total_ms is None and long.completion_tokens is None
    first, second = by_index[2], by_index[3]
    assert not first.cut_after_first_token and first.completion_tokens == 8
    assert second.sent_s is not None and first.sent_s is not None
    assert second.sent_s >= first.sent_s + first.total_ms / 1000.0 * 0.9
