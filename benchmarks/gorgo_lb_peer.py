"""gorgo-lb, the GORGO paper authors' own router (PyPI ``gorgo-lb``), as a peer in the routing benchmark.

    python benchmarks/gorgo_lb_peer.py CONFIG.json    # prints "READY {"url": ..., "region_urls": {...}}"

gorgo-lb ships the policy (``gorgo.policy.gorgo.route_gorgo`` / ``route_gorgo_2d`` over a
``RouteContext``), its prefix index (``gorgo.radix_trie.RadixTrie``), the online ES tuner
(``gorgo.tuner.OnlineTuner``) and AIBrix-derived baselines; the caller owns transport and state.
This adapter is that caller, written after the reference integration (the GORGO repository's
``proxy/modal_proxy.py``) and fed the inputs gorgo's own gateways get in the benchmark:

- RTT: from the adapter's region to each node, the topology's table as ``publish_policy`` writes
  it for the gateways (RTT plus the mean jitter), as ``ReplicaSnapshot.network_rtt`` (what the
  paper's proxy fills from its EWMA probe);
- queued tokens: the paper's own counter (prompt tokens this adapter dispatched to a node and not
  yet completed; released at the end of the answer, the proxy's default ``load_release_at_ttft =
  False``), and, so that one region's adapter sees the others' traffic, the node's ``/metrics``
  scraped every ``scrape_interval_s`` (gorgo's telemetry interval, 5 s) and parsed by gorgo's
  telemetry parser: (running + waiting requests) x the node's mean prompt tokens. The larger of
  the two counts, the way gorgo-lb's own ``least-request`` merges its local counter with a scrape;
- token ids for the trie: the emulator's own tokenizer (``simulator.tokenizer``, the ids the nodes
  compute), inserted once the chosen node answers 2xx, as the reference proxy does;
- prefill speed: ``route_gorgo`` has no slot for it (its ``prefill_weight`` absorbs it, and is what
  the ES tunes); ``route_gorgo_2d`` takes it as ``prefill_rate`` (ms per token), with ``queue_rate``
  the same (a queued token drains at prefill speed).

Every request is proxied to the chosen node through that node's port for the adapter's region, so
it pays the same emulated WAN as the gateways' requests. The central deployment (one adapter for
every client) also listens once per other client region behind a ``TcpDelayProxy`` with that
region's RTT to it, so those clients pay their way to the proxy and back.

The harness side (``start_adapters``) and the variants the benchmark reports (``VARIANTS``) are
here too; ``routing_quality.py`` only dispatches to them. ``routing/`` never imports this file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import msgspec
from aiohttp import web

from simulator.tcp_delay import TcpDelayProxy
from simulator.tokenizer import render_chat, tokenize
from simulator.topology import Topology
from telemetry.vllm_metrics import MetricsParseError, parse_metrics

NODE_HEADER = "x-gorgo-sim-node"  # which node answered; the benchmark's client reads it
SCRAPE_INTERVAL_S = 5.0  # gorgo's telemetry (GORGO_SCRAPE_INTERVAL_S's default)
SCRAPE_TIMEOUT_S = 2.0  # the reference proxy's METRICS_FETCH_TIMEOUT_SECONDS
MAX_REQUEST_SAMPLES = 1000  # the reference proxy's tuning ring buffer
# The online tuner's window and hop. The package's defaults (100 and 50 requests) would not
# complete one step in a benchmark run: a run's warm-up is 32 requests, split over the regions'
# adapters. These let each adapter take a step every ~10 of its requests.
TUNE_WINDOW_REQUESTS = 20
TUNE_HOP_REQUESTS = 10
_HOP_BY_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "upgrade",
        "te",
        "trailer",
        "content-encoding",
        "content-length",
    }
)


# ---- the variants the benchmark reports ----------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One gorgo-lb deployment: its policy (a ``gorgo.policy`` registry name) and how it runs."""

    policy: str = "gorgo"
    central: bool = False  # one adapter in one region instead of one per region
    tune: bool = False  # the package's online ES tuner on from the first (warm-up) request
    physical_rates: bool = False  # prefill_rate / queue_rate = the fleet's ms per token (gorgo-2d)
    scrape_interval_s: float = SCRAPE_INTERVAL_S


VARIANTS: dict[str, Variant] = {
    "gorgo-lb": Variant(),
    "gorgo-lb@central": Variant(central=True),
    "gorgo-lb+es": Variant(tune=True),
    "gorgo-lb-2d": Variant("gorgo-2d", physical_rates=True),
    "gorgo-lb/prefix-cache": Variant("prefix-cache"),  # AIBrix-derived, from gorgo.policy.lb_aibrix
    # A sensitivity row: the nodes' load scraped as often as gorgo's gateways exchange theirs
    # (routing.state.sharing's load_interval_s), so that only the policies differ, not the data.
    "gorgo-lb@scrape-100ms": Variant(scrape_interval_s=0.1),
}


def describe() -> dict[str, Any]:
    """What the results' ``meta`` records of the gorgo-lb runs."""
    from importlib.metadata import version

    return {
        "package": f"gorgo-lb {version('gorgo-lb')}",
        "variants": {name: asdict(variant) for name, variant in VARIANTS.items()},
        "scrape_interval_s": SCRAPE_INTERVAL_S,
        "tuner": {
            "objective": "neg_p95_ttft (the package's default)",
            "window_requests": TUNE_WINDOW_REQUESTS,
            "hop_requests": TUNE_HOP_REQUESTS,
            "when": "on from the first warm-up request, kept on through the measured requests "
            "until the ES converges (the package's OnlineTuner then pins its best weights)",
        },
    }


def installed() -> bool:
    """Whether the ``peers`` extra put gorgo-lb beside this Python."""
    try:
        import gorgo.policy.gorgo  # noqa: F401
    except ImportError:
        return False
    return True


# ---- the adapter's configuration ------------------------------------------------------------------


class NodeTarget(msgspec.Struct, frozen=True):
    name: str
    url: str  # the node's port for the adapter's region: requests pay that region's WAN delay
    rtt_ms: float  # from the adapter's region


class AdapterConfig(msgspec.Struct, frozen=True):
    region: str
    policy: str
    nodes: list[NodeTarget]
    kv_capacity_tokens: int
    prefill_ms_per_token: float
    scrape_interval_s: float = SCRAPE_INTERVAL_S
    hyperparameters: dict[str, float] = {}  # over the package's defaults
    tune: bool = False
    tune_window_requests: int = TUNE_WINDOW_REQUESTS
    tune_hop_requests: int = TUNE_HOP_REQUESTS
    seed: int = 1
    client_rtt_ms: dict[str, float] = {}  # central: region -> RTT of its clients to this adapter


@dataclass(frozen=True)
class NodeScrape:
    """What one scrape of a node's /metrics says, reduced to what the policies read."""

    running: int
    waiting: int
    kv_used_tokens: int
    mean_prompt_tokens: float | None
    latency_s: float


# ---- routing: the package's policy over this adapter's state -------------------------------------


class Router:
    """gorgo-lb's state as the reference proxy keeps it, and one decision per request."""

    def __init__(self, config: AdapterConfig) -> None:
        from gorgo.policy.gorgo import make_default_store
        from gorgo.radix_trie import RadixTrie
        from gorgo.tuner import OnlineTuner

        self.config = config
        self.nodes = {node.url: node for node in config.nodes}
        self.trie = RadixTrie()
        self.queued_tokens = dict.fromkeys(self.nodes, 0)
        self.queued_uncached_tokens = dict.fromkeys(self.nodes, 0)
        self.inflight_requests = dict.fromkeys(self.nodes, 0)
        self.scrapes: dict[str, NodeScrape] = {}
        self.unreachable: set[str] = set()  # failed its last scrape or request: no snapshot
        store = make_default_store()
        store["defaults"].update(config.hyperparameters)
        if config.policy == "gorgo-2d" and "prefill_rate" not in config.hyperparameters:
            store["defaults"]["prefill_rate"] = config.prefill_ms_per_token
            store["defaults"]["queue_rate"] = config.prefill_ms_per_token
        self.hyperparameters: dict[str, Any] = store
        self.samples: deque[dict[str, Any]] = deque(maxlen=MAX_REQUEST_SAMPLES)
        self.tuner = OnlineTuner(window_size=config.tune_window_requests, hop_size=config.tune_hop_requests)
        self.tune_events: list[dict[str, Any]] = []
        if config.tune:
            error = self.tuner.configure(
                {"enabled": True, "mode": "online-es"},
                active_policy=config.policy,
                current_defaults=store["defaults"],
            )
            if error:
                raise ValueError(f"gorgo-lb tuner: {error}")
            assert self.tuner.online_tuner is not None
            # The package seeds its ES from the system's entropy; seeded by run and region, a run
            # repeats and the regions' adapters still draw mutations of their own.
            self.tuner.online_tuner._rng = random.Random(f"{config.seed}:{config.region}")
            self.tuner.on_event = self.tune_events.append

    def snapshots(self) -> dict[str, Any]:
        """``ReplicaSnapshot`` per reachable node: the scraped gauges and the table's RTT."""
        from gorgo.policy.base import ReplicaSnapshot

        out: dict[str, Any] = {}
        for url, node in self.nodes.items():
            if url in self.unreachable:
                continue
            scraped = self.scrapes.get(url)
            out[url] = ReplicaSnapshot(
                num_running_reqs=scraped.running if scraped else 0,
                num_queue_reqs=scraped.waiting if scraped else 0,
                num_used_tokens=scraped.kv_used_tokens if scraped else 0,
                latency=scraped.latency_s if scraped else node.rtt_ms / 1000.0,
                network_rtt=node.rtt_ms / 1000.0,
            )
        return out

    def queued_view(self) -> dict[str, int]:
        """Tokens queued per node: this adapter's own counter, or what the last scrape implies."""
        view: dict[str, int] = {}
        for url, own in self.queued_tokens.items():
            scraped = self.scrapes.get(url)
            estimate = 0
            if scraped is not None:
                mean = scraped.mean_prompt_tokens or self._own_mean_prompt_tokens()
                estimate = round((scraped.running + scraped.waiting) * mean)
            view[url] = max(own, estimate)
        return view

    def _own_mean_prompt_tokens(self) -> float:
        prompts = [s["prompt_tokens"] for s in self.samples if s.get("prompt_tokens")]
        return sum(prompts) / len(prompts) if prompts else 0.0

    def choose(self, token_ids: list[int]) -> tuple[NodeTarget, int]:
        """The node gorgo-lb's policy picks, and the prompt's uncached tokens there."""
        from gorgo.policy.base import RouteContext, get_policy

        urls = list(self.nodes)
        context = RouteContext(
            replica_urls=urls,
            metrics=self.snapshots(),
            endpoints_queued_tokens=self.queued_view(),
            endpoints_queued_uncached_tokens=dict(self.queued_uncached_tokens),
            endpoints_inflight_requests=dict(self.inflight_requests),
            radix_trie=self.trie,
            token_ids=token_ids,
            request_tokens=len(token_ids),
            hyperparameters=self.hyperparameters,
        )
        decision = get_policy(self.config.policy).fn(context)
        cached = self.trie.cached_prefix_length(token_ids, decision.target) if token_ids else 0
        return self.nodes[decision.target], max(0, len(token_ids) - cached)

    def dispatched(self, url: str, request_tokens: int, uncached_tokens: int) -> None:
        self.queued_tokens[url] += request_tokens
        self.queued_uncached_tokens[url] += uncached_tokens
        self.inflight_requests[url] += 1

    def released(self, url: str, request_tokens: int, uncached_tokens: int) -> None:
        self.queued_tokens[url] = max(0, self.queued_tokens[url] - request_tokens)
        self.queued_uncached_tokens[url] = max(0, self.queued_uncached_tokens[url] - uncached_tokens)
        self.inflight_requests[url] = max(0, self.inflight_requests[url] - 1)

    def record_sample(self, url: str, ttft_s: float, total_s: float, prompt_tokens: int) -> None:
        """One answered request, as the reference proxy records it; the tuner may move the weights."""
        self.samples.append(
            {"ttft_seconds": ttft_s, "total_seconds": total_s, "prompt_tokens": prompt_tokens, "target": url}
        )
        new_store = self.tuner.on_sample(self.samples, self.hyperparameters, policy=self.config.policy)
        if new_store is not None:
            self.hyperparameters = new_store

    def scraped(self, url: str, text: str, latency_s: float) -> None:
        try:
            scrape = parse_metrics(text, time.time())
        except MetricsParseError:
            self.unreachable.add(url)
            return
        prompt = sum(scrape.counters.get("prompt_tokens", {}).values())
        finished = sum(scrape.counters.get("requests_finished", {}).values())
        self.scrapes[url] = NodeScrape(
            running=int(scrape.gauges.get("num_running", 0)),
            waiting=int(scrape.gauges.get("num_waiting", 0)),
            kv_used_tokens=round(scrape.gauges.get("kv_cache_usage", 0.0) * self.config.kv_capacity_tokens),
            mean_prompt_tokens=prompt / finished if finished else None,
            latency_s=latency_s,
        )
        self.unreachable.discard(url)


# ---- the HTTP side: OpenAI-compatible endpoints, streamed through -------------------------------


def prompt_token_ids(body: Mapping[str, Any]) -> list[int]:
    """The ids the emulated node computes for a chat request (its template and tokenizer)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    rendered = [
        {
            "role": str(m.get("role", "user")),
            "content": m["content"] if isinstance(m.get("content"), str) else "",
        }
        for m in messages
        if isinstance(m, dict)
    ]
    return tokenize(render_chat(rendered))


def _quantile(ordered: list[float], q: float) -> float | None:
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2) if ordered else None


def _first_content_at(chunk: bytes) -> bool:
    """Whether an SSE chunk carries answer text (the first one is the request's first token)."""
    for line in chunk.split(b"\n"):
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            continue
        for choice in event.get("choices") or ():
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                return True
    return False


class Adapter:
    """The aiohttp application: ``/v1/chat/completions`` routed by gorgo-lb, the rest passed on."""

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        self.router = Router(config)
        self.http: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Body read + tokenize + decide, per request: the adapter's own cost (a Python process).
        self.decide_ms: deque[float] = deque(maxlen=MAX_REQUEST_SAMPLES)
        # How late a 10 ms timer fires: a saturated event loop delays every request it carries.
        self.loop_lag_ms: deque[float] = deque(maxlen=MAX_REQUEST_SAMPLES)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/gorgo-lb/state", self.state)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        # No read timeout (a long prefill is not an error), as the reference proxy's client.
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None, connect=10.0)
        )
        await self.scrape_all()
        self._tasks = [asyncio.create_task(self._scrape_loop()), asyncio.create_task(self._lag_loop())]

    async def _stop(self, _app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.http is not None:
            await self.http.close()

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.scrape_interval_s)
            await self.scrape_all()

    async def _lag_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(0.01)
            self.loop_lag_ms.append((loop.time() - before - 0.01) * 1000.0)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(node) for node in self.config.nodes))

    async def _scrape(self, node: NodeTarget) -> None:
        assert self.http is not None
        started = time.perf_counter()
        try:
            async with self.http.get(
                f"{node.url}/metrics", timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
            ) as response:
                text = await response.text() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            text = None
        if text is None:
            self.router.unreachable.add(node.url)
            return
        self.router.scraped(node.url, text, time.perf_counter() - started)

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="")

    async def state(self, _request: web.Request) -> web.Response:
        """The weights in use, the tuner's steps and the adapter's own figures, for the results."""
        ttfts_ms = sorted(s["ttft_seconds"] * 1000.0 for s in self.router.samples)
        decide_ms = sorted(self.decide_ms)
        lag_ms = sorted(self.loop_lag_ms)
        return web.json_response(
            {
                "hyperparameters": self.router.hyperparameters,
                "tune_events": self.router.tune_events,
                "requests": len(decide_ms),
                "decide_ms_p50": _quantile(decide_ms, 0.5),
                "decide_ms_p99": _quantile(decide_ms, 0.99),
                "upstream_ttft_ms_p50": _quantile(ttfts_ms, 0.5),
                "upstream_ttft_ms_p99": _quantile(ttfts_ms, 0.99),
                "loop_lag_ms_p50": _quantile(lag_ms, 0.5),
                "loop_lag_ms_p99": _quantile(lag_ms, 0.99),
            }
        )

    async def models(self, _request: web.Request) -> web.Response:
        assert self.http is not None
        async with self.http.get(f"{self.config.nodes[0].url}/v1/models") as response:
            return web.Response(
                body=await response.read(), status=response.status, content_type="application/json"
            )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        assert self.http is not None
        arrived = time.perf_counter()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response({"error": {"message": "invalid JSON body"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "body must be a JSON object"}}, status=400)
        token_ids = prompt_token_ids(body)
        node, uncached = self.router.choose(token_ids)
        self.router.dispatched(node.url, len(token_ids), uncached)
        started = time.perf_counter()
        self.decide_ms.append((started - arrived) * 1000.0)
        ttft_s: float | None = None
        status = 502
        response: web.StreamResponse | None = None
        try:
            async with self.http.post(
                f"{node.url}/v1/chat/completions",
                data=raw,
                headers={"content-type": "application/json", "accept-encoding": "identity"},
            ) as upstream:
                status = upstream.status
                if 200 <= status < 300 and token_ids:
                    self.router.trie.insert(token_ids, endpoint=node.url)
                headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP_HEADERS}
                headers.setdefault(NODE_HEADER, node.name)
                response = web.StreamResponse(status=status, headers=headers)
                await response.prepare(request)
                try:
                    async for chunk in upstream.content.iter_any():
                        if ttft_s is None and _first_content_at(chunk):
                            ttft_s = time.perf_counter() - started
                        await response.write(chunk)
                    await response.write_eof()
                except aiohttp.ClientPayloadError:
                    pass  # the node died mid-answer: the client sees a cut stream, as from the node
                except ConnectionResetError:
                    pass  # the client hung up (it may, once it has read [DONE]); leaving aborts upstream
        except aiohttp.ClientConnectionError as exc:
            if response is not None and response.prepared:
                return response  # the node died mid-answer, after its first bytes
            self.router.unreachable.add(node.url)  # until its next scrape answers
            return web.json_response({"error": {"message": f"upstream {node.name}: {exc}"}}, status=502)
        finally:
            self.router.released(node.url, len(token_ids), uncached)
        if status == 200 and ttft_s is not None:
            self.router.record_sample(node.url, ttft_s, time.perf_counter() - started, len(token_ids))
        return response


async def serve(config: AdapterConfig) -> None:
    adapter = Adapter(config)
    runner = web.AppRunner(adapter.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[-1][1]}"
    print("READY " + json.dumps({"url": url}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


async def serve_delays(upstream_port: int, rtt_ms_by_region: dict[str, float]) -> None:
    """The central proxy's far clients: one delay proxy per region, in a process of its own so
    their byte shuffling does not share the adapter's event loop."""
    delays: list[TcpDelayProxy] = []
    region_urls: dict[str, str] = {}
    for region, rtt_ms in sorted(rtt_ms_by_region.items()):
        delay = TcpDelayProxy("127.0.0.1", upstream_port, rtt_ms=rtt_ms)
        region_urls[region] = f"http://127.0.0.1:{await delay.start()}"
        delays.append(delay)
    print("READY " + json.dumps({"region_urls": region_urls}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for delay in delays:
            await delay.close()


# ---- the harness side ---------------------------------------------------------------------------


def converged_rtt_ms(topology: Topology, client_region: str, node_region: str) -> float:
    """What a probe's EWMA converges to (as ``publish_policy`` writes it): RTT + the mean jitter."""
    return topology.rtt_ms(client_region, node_region) + topology.jitter_ms(client_region, node_region) / 2


def central_region(topology: Topology, client_shares: Mapping[str, float] | None) -> str:
    """Where the one central proxy runs: the region with the most clients; among equals, the one
    with the lowest client-weighted mean RTT to the others (the paper runs its proxy beside its
    clients)."""
    regions = [r.slug for r in topology.regions]
    shares = {r: (client_shares or {}).get(r, 0.0 if client_shares else 1.0) for r in regions}

    def weighted_rtt(candidate: str) -> float:
        return sum(shares[r] * topology.rtt_ms(r, candidate) for r in regions if r != candidate)

    return min(regions, key=lambda r: (-round(shares[r], 6), weighted_rtt(r), r))


def adapter_configs(
    policy: str,
    fleet_nodes: list[dict[str, Any]],
    topology: Topology,
    client_shares: Mapping[str, float] | None,
    *,
    prefill_tokens_per_s: float,
    kv_capacity_tokens: int,
    seed: int,
) -> list[AdapterConfig]:
    """One config per adapter the variant runs: one per region, or one central one."""
    variant = VARIANTS[policy]
    regions = [r.slug for r in topology.regions]
    homes = [central_region(topology, client_shares)] if variant.central else regions
    configs = []
    for home in homes:
        nodes = [
            NodeTarget(
                node["name"], node["region_urls"][home], converged_rtt_ms(topology, home, node["region"])
            )
            for node in fleet_nodes
        ]
        client_rtt = (
            {r: converged_rtt_ms(topology, r, home) for r in regions if r != home} if variant.central else {}
        )
        configs.append(
            AdapterConfig(
                region=home,
                policy=variant.policy,
                nodes=nodes,
                kv_capacity_tokens=kv_capacity_tokens,
                prefill_ms_per_token=1000.0 / prefill_tokens_per_s,
                tune=variant.tune,
                scrape_interval_s=variant.scrape_interval_s,
                seed=seed,
                client_rtt_ms=client_rtt,
            )
        )
    return configs


@dataclass
class Adapters:
    """The adapter processes of one run, the URL each client region uses, and each adapter's own."""

    procs: list[Any]
    targets: dict[str, str]  # client region -> URL (central: behind that region's RTT)
    homes: dict[str, str]  # adapter region -> its own URL

    def state(self) -> dict[str, Any]:
        """Per adapter: the weights it ended the run with and what its tuner did (for the results)."""
        out: dict[str, Any] = {}
        for region, url in self.homes.items():
            try:
                state = httpx.get(f"{url}/gorgo-lb/state", timeout=5.0).json()
            except (httpx.HTTPError, ValueError) as exc:
                out[region] = {"error": str(exc)[:200]}
                continue
            events = state["tune_events"]
            weights = state["hyperparameters"]["defaults"]
            out[region] = {
                "weights": {k: round(v, 4) for k, v in weights.items() if k in WEIGHT_KEYS},
                "tuner_steps": len(events),
                "tuner_accepted": sum(1 for e in events if e.get("accepted")),
                "tuner_converged": any(e.get("converged") for e in events),
                **{key: state.get(key) for key in ADAPTER_FIGURES},
            }
        return out


# Per adapter: requests, its own cost per request, and TTFT as it sees it (dispatch to first token).
ADAPTER_FIGURES = (
    "requests",
    "decide_ms_p50",
    "decide_ms_p99",
    "upstream_ttft_ms_p50",
    "upstream_ttft_ms_p99",
    "loop_lag_ms_p50",
    "loop_lag_ms_p99",
)
WEIGHT_KEYS = ("rtt_weight", "prefill_weight", "load_weight", "queue_weight", "prefill_rate", "queue_rate")


def start_adapters(
    configs: list[AdapterConfig],
    regions: list[str],
    workdir: Path,
    spawn: Callable[..., Any],
    wait_ready: Callable[..., Any],
) -> Adapters:
    """Start each adapter as its own process (``spawn`` and ``wait_ready`` are the harness's), and
    for a central one, its far clients' delay proxies in another."""
    adapters = Adapters([], {}, {})
    for config in configs:
        path = workdir / f"gorgo-lb-{config.region}.json"
        path.write_bytes(msgspec.json.encode(config))
        adapters.procs.append(
            spawn(f"gorgo-lb-{config.region}", [sys.executable, __file__, str(path)], workdir)
        )
    for config, proc in zip(configs, list(adapters.procs), strict=True):
        url = _ready(proc, wait_ready)["url"]
        adapters.homes[config.region] = adapters.targets[config.region] = url
        if config.client_rtt_ms:
            port = url.rsplit(":", 1)[1]
            delays = [f"{region}={rtt_ms}" for region, rtt_ms in config.client_rtt_ms.items()]
            delay_proc = spawn(
                f"gorgo-lb-delays-{config.region}",
                [sys.executable, __file__, "--delay", port, *delays],
                workdir,
            )
            adapters.procs.append(delay_proc)
            adapters.targets.update(_ready(delay_proc, wait_ready)["region_urls"])
    missing = sorted(set(regions) - set(adapters.targets))
    if missing:
        raise RuntimeError(f"no gorgo-lb adapter serves the clients of {missing}")
    return adapters


def _ready(proc: Any, wait_ready: Callable[..., Any]) -> dict[str, Any]:
    def described() -> dict[str, Any] | None:
        line = next((ln for ln in proc.log().splitlines() if ln.startswith("READY ")), None)
        return json.loads(line[len("READY ") :]) if line else None

    return wait_ready(proc, described)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", help="AdapterConfig as JSON (written by start_adapters)")
    parser.add_argument(
        "--delay", nargs="+", metavar="PORT REGION=RTT_MS", help="serve delay proxies to PORT instead"
    )
    args = parser.parse_args()
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        if args.delay:
            port, *pairs = args.delay
            rtts = {region: float(ms) for region, _, ms in (pair.partition("=") for pair in pairs)}
            uvloop.run(serve_delays(int(port), rtts))
        elif args.config:
            uvloop.run(serve(msgspec.json.decode(Path(args.config).read_bytes(), type=AdapterConfig)))
        else:
            parser.error("give a config file or --delay")
    return 0


if __name__ == "__main__":
    sys.exit(main())
