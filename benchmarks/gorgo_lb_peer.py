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


VARIANTS: dict[str, Variant] = {
    "gorgo-lb": Variant(),
    "gorgo-lb@central": Variant(central=True),
    "gorgo-lb+es": Variant(tune=True),
    "gorgo-lb-2d": Variant("gorgo-2d", physical_rates=True),
    "gorgo-lb/prefix-cache": Variant("prefix-cache"),  # AIBrix-derived, from gorgo.policy.lb_aibrix
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
            # The package seeds its ES from the system's entropy; a seeded one repeats per run.
            self.tuner.online_tuner._rng = random.Random(config.seed)
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
        self.http: httpx.AsyncClient | None = None
        self._scraper: asyncio.Task[None] | None = None

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
        # The reference proxy's client: no read timeout (a long prefill is not an error), pooled.
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=10.0, read=None, write=30.0, pool=10.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=256),
        )
        await self.scrape_all()
        self._scraper = asyncio.create_task(self._scrape_loop())

    async def _stop(self, _app: web.Application) -> None:
        if self._scraper is not None:
            self._scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scraper
        if self.http is not None:
            await self.http.aclose()

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.scrape_interval_s)
            await self.scrape_all()

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(node) for node in self.config.nodes))

    async def _scrape(self, node: NodeTarget) -> None:
        assert self.http is not None
        started = time.perf_counter()
        try:
            response = await self.http.get(f"{node.url}/metrics", timeout=SCRAPE_TIMEOUT_S)
        except httpx.HTTPError:
            self.router.unreachable.add(node.url)
            return
        if response.status_code != 200:
            self.router.unreachable.add(node.url)
            return
        self.router.scraped(node.url, response.text, time.perf_counter() - started)

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="")

    async def state(self, _request: web.Request) -> web.Response:
        """The weights in use and the tuner's steps: what the benchmark records of a run."""
        return web.json_response(
            {"hyperparameters": self.router.hyperparameters, "tune_events": self.router.tune_events}
        )

    async def models(self, _request: web.Request) -> web.Response:
        assert self.http is not None
        response = await self.http.get(f"{self.config.nodes[0].url}/v1/models")
        return web.Response(
            body=response.content, status=response.status_code, content_type="application/json"
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        assert self.http is not None
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
        ttft_s: float | None = None
        response: web.StreamResponse | None = None
        try:
            upstream_request = self.http.build_request(
                "POST",
                f"{node.url}/v1/chat/completions",
                content=raw,
                headers={"content-type": "application/json", "accept-encoding": "identity"},
            )
            try:
                upstream = await self.http.send(upstream_request, stream=True)
            except httpx.HTTPError as exc:
                self.router.unreachable.add(node.url)  # until its next scrape answers
                return web.json_response({"error": {"message": f"upstream {node.name}: {exc}"}}, status=502)
            try:
                if 200 <= upstream.status_code < 300 and token_ids:
                    self.router.trie.insert(token_ids, endpoint=node.url)
                headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP_HEADERS}
                headers.setdefault(NODE_HEADER, node.name)
                response = web.StreamResponse(status=upstream.status_code, headers=headers)
                await response.prepare(request)
                async for chunk in upstream.aiter_raw():
                    if ttft_s is None and _first_content_at(chunk):
                        ttft_s = time.perf_counter() - started
                    await response.write(chunk)
                await response.write_eof()
            except httpx.HTTPError:
                pass  # the node died mid-answer: the client sees a cut stream, as from the node
            finally:
                await upstream.aclose()
            if upstream.status_code == 200 and ttft_s is not None:
                self.router.record_sample(node.url, ttft_s, time.perf_counter() - started, len(token_ids))
            return response
        finally:
            self.router.released(node.url, len(token_ids), uncached)


async def serve(config: AdapterConfig) -> None:
    adapter = Adapter(config)
    runner = web.AppRunner(adapter.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[-1][1]
    url = f"http://127.0.0.1:{port}"
    region_urls = {config.region: url}
    delays: list[TcpDelayProxy] = []
    for region, rtt_ms in sorted(config.client_rtt_ms.items()):
        delay = TcpDelayProxy("127.0.0.1", port, rtt_ms=rtt_ms)
        region_urls[region] = f"http://127.0.0.1:{await delay.start()}"
        delays.append(delay)
    print("READY " + json.dumps({"url": url, "region_urls": region_urls}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for delay in delays:
            await delay.close()
        await runner.cleanup()


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
                seed=seed,
                client_rtt_ms=client_rtt,
            )
        )
    return configs


def start_adapters(
    configs: list[AdapterConfig],
    regions: list[str],
    workdir: Path,
    spawn: Callable[..., Any],
    wait_ready: Callable[..., Any],
) -> tuple[list[Any], dict[str, str]]:
    """Start each adapter as its own process; returns them and the URL each client region uses."""
    procs: list[Any] = []
    targets: dict[str, str] = {}
    for config in configs:
        path = workdir / f"gorgo-lb-{config.region}.json"
        path.write_bytes(msgspec.json.encode(config))
        procs.append(spawn(f"gorgo-lb-{config.region}", [sys.executable, __file__, str(path)], workdir))
    for proc in procs:

        def ready(proc: Any = proc) -> dict[str, Any] | None:
            line = next((ln for ln in proc.log().splitlines() if ln.startswith("READY ")), None)
            return json.loads(line[len("READY ") :]) if line else None

        described = wait_ready(proc, ready)
        for region, url in described["region_urls"].items():
            if region in regions:
                targets.setdefault(region, url)
    return procs, targets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="AdapterConfig as JSON (written by start_adapters)")
    args = parser.parse_args()
    config = msgspec.json.decode(Path(args.config).read_bytes(), type=AdapterConfig)
    try:
        import uvloop

        uvloop.run(serve(config))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
