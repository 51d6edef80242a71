"""Workloads that reveal coordination between regions (client mixes, diurnal, region-outage) and
the fleet's oracle bound (the fastest first token any node could give a request as it arrives)."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from simulator.control import serve_control
from simulator.harness import free_port
from simulator.server import oracle_key_of
from simulator.traffic import build_plan
from simulator.traffic.workloads import DIURNAL_PEAK_SHARE, check_client_shares
from tests.simulator.conftest import FAR_RTT_MS, FleetFactory

REGIONS = ["us-east", "eu-central", "ap-south"]


def plan(workload: str, **options):
    return build_plan(
        workload, REGIONS, rate_rps=20.0, duration_s=300.0, max_requests=3000, seed=1, **options
    )


def test_client_shares_weigh_the_regions() -> None:
    counts = Counter(
        a.client_region
        for a in plan("geo-chat", client_shares={"ap-south": 4, "us-east": 3, "eu-central": 3}).arrivals
    )
    assert counts["ap-south"] / 3000 == pytest.approx(0.4, abs=0.03)
    assert counts["us-east"] / 3000 == pytest.approx(0.3, abs=0.03)
    only = Counter(a.client_region for a in plan("no-share", client_shares={"eu-central": 1.0}).arrivals)
    assert set(only) == {"eu-central"}


@pytest.mark.parametrize(
    ("shares", "message"),
    [
        ({"mars": 1.0}, "unknown region(s) ['mars']"),
        ({"us-east": -1.0, "ap-south": 2.0}, "non-negative"),
        ({"us-east": 0.0}, "more than 0"),
    ],
)
def test_bad_client_shares_are_refused_by_name(shares: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match="client shares") as error:
        check_client_shares(tuple(REGIONS), shares)
    assert message in str(error.value)


def test_diurnal_moves_the_peak_from_region_to_region() -> None:
    arrivals = plan("diurnal").arrivals
    third = len(arrivals) // 3
    for phase, region in enumerate(REGIONS):
        counts = Counter(a.client_region for a in arrivals[phase * third : (phase + 1) * third])
        assert counts.most_common(1)[0][0] == region
        assert counts[region] / third == pytest.approx(DIURNAL_PEAK_SHARE, abs=0.06)
    assert all(a.system_prompt is None and a.turn == 0 for a in arrivals)  # unique prompts


def test_region_outage_plans_the_first_regions_nodes_down_mid_run_and_back() -> None:
    outage_plan = plan("region-outage")
    (outage,) = outage_plan.outages
    last_s = outage_plan.arrivals[-1].at_s
    assert outage.region == "us-east"
    assert 0.2 * last_s < outage.start_s < outage.end_s < 0.7 * last_s
    assert outage_plan.system_prompts  # geo-chat traffic
    assert plan("geo-chat").outages == ()


async def test_the_oracle_is_rtt_plus_the_prefill_of_what_the_best_node_lacks(
    make_fleet: FleetFactory,
) -> None:
    fleet = await make_fleet(only=["node-a", "node-b"], prefill_tokens_per_s=10_000.0)
    fleet.record_oracle()
    port = free_port()
    control = await serve_control(fleet, "127.0.0.1", port)
    text = "hello " * 400
    body = {
        "model": fleet.node("node-a").model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
    }
    try:
        async with httpx.AsyncClient(timeout=30.0) as http:
            first = await http.post(
                f"{fleet.url('node-a')}/v1/chat/completions", json=body, headers={"X-Gorgo-Region": "near"}
            )
            assert first.status_code == 200
            cold = (await http.get(f"http://127.0.0.1:{port}/oracle")).json()["requests"]
            key = oracle_key_of(text, 1)
            region, cold_ms, cold_rtt_ms, cold_compute_ms = cold[key]
            prompt_tokens = first.json()["usage"]["prompt_tokens"]
            step_ms = fleet.node("node-a").params.decode_step_base_ms
            # Nothing cached anywhere: the local node, its RTT, one step and the whole prefill.
            assert region == "near"
            assert cold_ms == pytest.approx(1.0 + step_ms + prompt_tokens / 10.0, rel=0.01)
            assert (cold_rtt_ms, cold_compute_ms) == pytest.approx(
                (1.0, step_ms + prompt_tokens / 10.0), rel=0.01
            )

            # Sent again from far away: node-a now holds the prompt, but it is FAR_RTT_MS away;
            # node-b is next door and holds nothing. The bound is the better of the two.
            await http.post(
                f"{fleet.url('node-b')}/v1/chat/completions", json=body, headers={"X-Gorgo-Region": "far"}
            )
            region, warm_ms, _, _ = (await http.get(f"http://127.0.0.1:{port}/oracle")).json()["requests"][
                key
            ]
            cached_tokens = (prompt_tokens - 1) // 16 * 16
            via_a = FAR_RTT_MS + step_ms + (prompt_tokens - cached_tokens) / 10.0
            via_b = 1.0 + step_ms + prompt_tokens / 10.0
            assert region == "far"
            assert warm_ms == pytest.approx(min(via_a, via_b), rel=0.01)
    finally:
        await control.cleanup()


async def test_the_fleet_logs_what_each_request_spent_queued_and_prefilling(make_fleet: FleetFactory) -> None:
    # The routing benchmark splits each request's TTFT against the bound (issue 24): the node that
    # served it, its way into the engine, the wait for its first step, and its prefill up to the
    # first token.
    fleet = await make_fleet(only=["node-a"], prefill_tokens_per_s=10_000.0)
    fleet.record_oracle()
    port = free_port()
    control = await serve_control(fleet, "127.0.0.1", port)
    texts = [f"request {index} " + "words " * 600 for index in range(3)]
    try:
        async with httpx.AsyncClient(timeout=30.0) as http:

            async def send(text: str) -> httpx.Response:
                body = {"model": fleet.node("node-a").model, "messages": [{"role": "user", "content": text}]}
                return await http.post(
                    f"{fleet.url('node-a')}/v1/chat/completions", json={**body, "max_tokens": 2}
                )

            # Three at once: the engine prefills them in turn (its token budget), so some wait.
            answers = await asyncio.gather(*(send(text) for text in texts))
            assert all(answer.status_code == 200 for answer in answers)
            served = (await http.get(f"http://127.0.0.1:{port}/oracle")).json()["served"]
    finally:
        await control.cleanup()
    entries = [served[oracle_key_of(text, 1)] for text in texts]
    assert {node for node, *_ in entries} == {"node-a"}
    prompt_tokens = answers[0].json()["usage"]["prompt_tokens"]
    for _, intake_ms, queued_ms, prefill_ms, late_ms in entries:
        assert min(intake_ms, queued_ms, late_ms) >= 0
        assert prefill_ms >= prompt_tokens / 10.0 * 0.9  # at least its own prefill at 10 tokens/ms
    assert (
        max(queued_ms + prefill_ms for _, _, queued_ms, prefill_ms, _ in entries) > 2 * prompt_tokens / 10.0
    )
