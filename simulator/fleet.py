"""In-process API over a whole emulated fleet, for tests, benchmarks and the CLI.

    async with Fleet.start(topology, auto_ports=True, engine_overrides={"prefill_tokens_per_s": 10_000}) as fleet:
        url = fleet.url("us-east-1")
        fleet.node("us-east-1").engine.pool.usage   # inspect the engine
        await fleet.stop_node("us-east-1")          # crash: connections in flight are cut
        await fleet.start_node("us-east-1")         # restart on the same port, empty cache

    # One extra port per region on every node: requests there pay that region's WAN delay
    # without the X-Gorgo-Region header (for routers that cannot add it).
    async with Fleet.start(topology, auto_ports=True, region_ports=True) as fleet:
        fleet.node("us-east-1").url_for("ap-south")  # reach us-east-1 as an ap-south client

All nodes share the caller's event loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

from simulator.engine import SimRequest
from simulator.kv_cache import hash_block
from simulator.kv_events import KVEventsConfig, KVEventsConfigError, parse_kv_events_config
from simulator.server import SimNode
from simulator.tokenizer import clear_caches as clear_tokenizer_caches
from simulator.topology import Topology, TopologyError

MAX_ORACLE_RECORDS = 200_000  # bounded: a benchmark run sends a few thousand


class Fleet:
    """The emulated nodes of a topology (all of them, or ``only`` some), served on loopback."""

    def __init__(
        self,
        topology: Topology,
        *,
        host: str | None = None,
        auto_ports: bool = False,
        port_offset: int = 0,
        only: Iterable[str] | None = None,
        engine_overrides: Mapping[str, Any] | None = None,
        node_engine_overrides: Mapping[str, Mapping[str, Any]] | None = None,
        engine_defaults: Mapping[str, Any] | None = None,
        time_scale: float = 1.0,
        region_ports: bool = False,
        kv_events: Mapping[str, KVEventsConfig | str | Mapping[str, Any]] | None = None,
        enable_prompt_tokens_details: bool | None = None,
    ) -> None:
        """``enable_prompt_tokens_details`` (vLLM's flag) overrides every node's topology value.
        ``engine_defaults`` replace the topology's ``[engine]`` table (a node's own entries still
        win); ``engine_overrides`` then set every node's, ``node_engine_overrides`` one node's."""
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.topology = topology
        self.auto_ports = auto_ports
        self.region_ports = region_ports
        self._host = host
        self._port_offset = port_offset
        names = [node.name for node in topology.nodes]
        selected = list(only) if only is not None else names
        unknown = sorted(set(selected) - set(names))
        if unknown:
            raise TopologyError(f"unknown node(s) {unknown}; the topology has {names}")
        unknown = sorted(set(node_engine_overrides or {}) - set(names))
        if unknown:
            raise TopologyError(f"engine overrides for unknown node(s) {unknown}")
        unknown = sorted(set(kv_events or {}) - set(names))
        if unknown:
            raise TopologyError(f"kv_events_config for unknown node(s) {unknown}")
        self.nodes: dict[str, SimNode] = {}
        for spec in topology.nodes:
            if spec.name not in selected:
                continue
            params = (
                spec.engine_under(engine_defaults)
                .with_overrides(engine_overrides)
                .with_overrides((node_engine_overrides or {}).get(spec.name))
            )
            events = spec.kv_events
            if kv_events and spec.name in kv_events:
                raw = kv_events[spec.name]
                try:
                    events = raw if isinstance(raw, KVEventsConfig) else parse_kv_events_config(raw)
                except KVEventsConfigError as exc:
                    raise TopologyError(f"node {spec.name}: {exc}") from None
            if events is not None and (auto_ports or port_offset):
                events = _shift_ports(events, 0 if auto_ports else port_offset, auto=auto_ports)
            details = (
                spec.enable_prompt_tokens_details
                if enable_prompt_tokens_details is None
                else enable_prompt_tokens_details
            )
            self.nodes[spec.name] = SimNode(
                dataclasses.replace(
                    spec, engine=params, kv_events=events, enable_prompt_tokens_details=details
                ),
                topology,
                time_scale=time_scale,
            )
        # request key -> (client region, lower-bound TTFT ms, its RTT ms, its step + prefill ms),
        # filled while ``record_oracle`` is on
        self.oracle_ms: dict[str, tuple[str, float, float, float]] = {}
        # request key -> (node, intake ms: its HTTP request in to the engine, queued ms, prefill ms:
        # first scheduled to first token, late ms: how late the first token was written), the same
        self.served_ms: dict[str, tuple[str, float, float, float, float]] = {}

    def record_oracle(self, on: bool = True) -> None:
        """Log, for every chat request that arrives, the fastest first token the fleet could give.

        Per request: over every running node, the RTT from the client's region (topology, no
        jitter) + one engine step + the prefill of the tokens that node does NOT hold in its KV
        cache right now, at its prefill speed; no queue. The minimum is the lower bound a router
        with perfect knowledge could reach (benchmarks: ``GET /oracle`` on the control API).
        And, once its first token is out, what the request really spent at the node that served it:
        from its HTTP request's arrival to the engine (intake: reading, parsing and tokenizing it,
        and this bookkeeping, in the fleet's one process), from there to its first scheduled step
        (queue), from there to its first token (prefill, in steps shared with the batch's
        decodes), and how late the fleet's process wrote that token out, past when it was due (its
        own event-loop lag: a harness cost, 0 when the machine keeps up).
        """
        for node in self.nodes.values():
            node.oracle = self._oracle if on else None
            node.served = self._served if on else None

    def _served(self, node: SimNode, key: str, request: SimRequest, received_s: float) -> None:
        if len(self.served_ms) >= MAX_ORACLE_RECORDS or request.first_token_s is None:
            return
        scheduled_s = (
            request.first_scheduled_s if request.first_scheduled_s is not None else request.arrival_s
        )
        self.served_ms[key] = (
            node.name,
            (request.arrival_s - received_s) * 1000.0,
            (scheduled_s - request.arrival_s) * 1000.0,
            (request.first_token_s - scheduled_s) * 1000.0,
            (request.first_write_late_s or 0.0) * 1000.0,
        )

    def _oracle(self, arrived_at: SimNode, prompt_ids: list[int], region: str, key: str) -> None:
        if len(self.oracle_ms) >= MAX_ORACLE_RECORDS:
            return
        region = region or arrived_at.region
        best_ms = best_rtt_ms = best_compute_ms = float("inf")
        for node in self.nodes.values():
            engine = node.engine
            if engine is None or not engine.alive:
                continue
            params = node.params
            block = params.block_size
            full_blocks = (len(prompt_ids) - 1) // block  # vLLM computes at least the last token
            # Each engine chains its block hashes from its own random root (as vLLM does), so
            # the prefix is hashed per node, and only as far as that node holds it.
            parent = getattr(engine, "hash_root", 0)
            pool = engine.pool
            cached_blocks = 0
            for index in range(full_blocks):
                parent = hash_block(parent, prompt_ids[index * block : (index + 1) * block])
                if not pool.is_cached(parent):
                    break
                cached_blocks += 1
            cached = cached_blocks * block
            rtt_ms = self.topology.rtt_ms(region, node.region)
            compute_ms = (
                params.decode_step_base_ms + (len(prompt_ids) - cached) * 1000.0 / params.prefill_tokens_per_s
            )
            if rtt_ms + compute_ms < best_ms:
                best_ms, best_rtt_ms, best_compute_ms = rtt_ms + compute_ms, rtt_ms, compute_ms
        if best_ms < float("inf"):
            self.oracle_ms[key] = (region, best_ms, best_rtt_ms, best_compute_ms)

    @classmethod
    def start(cls, topology: Topology, **options: Any) -> Fleet:
        """A fleet to use as ``async with Fleet.start(...) as fleet`` (options as ``Fleet(...)``)."""
        return cls(topology, **options)

    async def __aenter__(self) -> Fleet:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def open(self) -> None:
        """Start every node; if one cannot bind, stop the ones already started and raise."""
        try:
            for name in self.nodes:
                await self.start_node(name)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        for node in self.nodes.values():
            await node.stop()

    # ------------------------------------------------------------------ access

    def node(self, name: str) -> SimNode:
        return self.nodes[name]

    def url(self, name: str) -> str:
        return self.nodes[name].url

    @property
    def urls(self) -> dict[str, str]:
        return {name: node.url for name, node in self.nodes.items()}

    def urls_for(self, region: str) -> dict[str, str]:
        """Node name -> the URL that reaches it as a client in ``region`` (needs ``region_ports``)."""
        return {name: node.url_for(region) for name, node in self.nodes.items()}

    def in_region(self, region: str) -> list[SimNode]:
        return [node for node in self.nodes.values() if node.region == region]

    # ------------------------------------------------------------------ failure emulation

    async def stop_node(self, name: str) -> None:
        """Emulate a crash: the engine dies, connections in flight are cut, the port closes."""
        await self.nodes[name].stop()

    async def reset(self) -> None:
        """Bring the fleet back to the state it started in, without a new process (benchmarks run
        policy after policy on one fleet): every node restarted on its ports (fresh engine: empty KV
        cache, nothing queued or running, zeroed counters; connections still open are cut), its WAN
        jitter drawn from the start of its seeded sequence again, the oracle's log emptied and the
        tokenizer's memoised ids forgotten."""
        for name, node in self.nodes.items():
            if node.running:
                await node.stop()
            node.reset_network()
            await self.start_node(name)
        self.oracle_ms.clear()
        self.served_ms.clear()
        clear_tokenizer_caches()

    async def start_node(self, name: str) -> None:
        """(Re)start a node: same port as before, fresh engine, empty KV cache, zeroed counters."""
        node = self.nodes[name]
        if node.bound_port is not None:
            port = node.bound_port  # a restart keeps its port, even an auto-assigned one
        else:
            port = 0 if self.auto_ports else node.spec.port + self._port_offset
        await node.start(self._host or node.spec.host, port, region_ports=self.region_ports)


def _shift_ports(config: KVEventsConfig, offset: int, *, auto: bool) -> KVEventsConfig:
    """The events' ports follow the HTTP ports: free ones with ``auto_ports``, else shifted."""

    def shift(endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{0 if auto or int(port) == 0 else int(port) + offset}"

    return dataclasses.replace(
        config,
        endpoint=shift(config.endpoint) or config.endpoint,
        replay_endpoint=shift(config.replay_endpoint),
    )
