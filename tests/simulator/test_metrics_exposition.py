"""/metrics speaks vLLM V1: names, labels, buckets, and counters that move as requests are served."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.simulator.conftest import MODEL, FleetFactory, chat_body

LABELS = {"model_name": MODEL, "engine": "0"}
REQUIRED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}


async def scrape(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Every sample as ``name{sorted labels}`` -> value."""
    response = await http.get(f"{url}/metrics")
    assert response.status_code == 200
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def key(name: str, **extra: str) -> str:
    labels = {**LABELS, **extra}
    return name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


async def test_it_exposes_vllms_metric_names_labels_and_types(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet()
    response = await http.get(f"{fleet.url('node-a')}/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name, kind in REQUIRED.items():
        assert name in families, name
        assert families[name].type == kind, name
        for sample in families[name].samples:
            assert {k: sample.labels[k] for k in LABELS} == LABELS, (name, sample.labels)
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}


async def test_it_uses_vllms_histogram_buckets(make_fleet: FleetFactory, http: httpx.AsyncClient) -> None:
    fleet = await make_fleet()
    response = await http.get(f"{fleet.url('node-a')}/metrics")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}

    def bounds(name: str) -> list[str]:
        return [s.labels["le"] for s in families[name].samples if s.name.endswith("_bucket")]

    assert bounds("vllm:time_to_first_token_seconds")[:4] == ["0.001", "0.005", "0.01", "0.02"]
    assert bounds("vllm:time_to_first_token_seconds")[-2:] == ["2560.0", "+Inf"]
    assert bounds("vllm:inter_token_latency_seconds")[:3] == ["0.01", "0.025", "0.05"]
    assert bounds("vllm:e2e_request_latency_seconds")[-2:] == ["7680.0", "+Inf"]
    assert bounds("vllm:request_queue_time_seconds") == bounds("vllm:e2e_request_latency_seconds")


async def test_it_counts_served_requests_and_tokens(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet()
    url = fleet.url("node-a")
    before = await scrape(http, url)
    response = await http.post(f"{url}/v1/chat/completions", json=chat_body("Tell me a story.", max_tokens=6))
    usage = response.json()["usage"]
    after = await scrape(http, url)

    def delta(name: str, **extra: str) -> float:
        return after[key(name, **extra)] - before[key(name, **extra)]

    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("vllm:prefix_cache_queries_total") == usage["prompt_tokens"]
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 5
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_decode_time_seconds_count") == 1
    assert after[key("vllm:num_requests_running")] == 0
    assert after[key("vllm:kv_cache_usage_perc")] == 0  # blocks stay cached but unreferenced


async def test_it_reports_running_requests_and_kv_usage_while_busy(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet(decode_step_base_ms=10.0)
    url = fleet.url("node-a")
    body = chat_body("A long answer please.", max_tokens=200, ignore_eos=True, stream=True)
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        async for _ in response.aiter_lines():
            break  # the answer has started: the request is running
        during = await scrape(http, url)
    assert during[key("vllm:num_requests_running")] == 1
    assert during[key("vllm:kv_cache_usage_perc")] > 0
