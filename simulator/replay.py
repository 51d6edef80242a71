"""What-if replay: recorded requests through a routing policy on the emulated fleet, in virtual time.

The control plane's what-if (``controlplane/policies/whatif.py``) asks: had this policy routed the
last N minutes of traffic, what TTFT would the users have seen? This module answers it without
processes or wall-clock waits:

- **The fleet** is one ``simulator.engine.Engine`` per node of the snapshot (the emulator's own
  scheduler: continuous batching, chunked prefill, prefix-caching KV blocks, preemption), sized
  from the node's ``NodeSpec`` (prefill speed, KV capacity, ``max_num_seqs``); step costs not in
  the spec (base step time, per-sequence decode time) are the emulator's H100 defaults.
- **The clock** is virtual: an asyncio loop whose ``time()`` jumps to the next timer instead of
  sleeping (``VirtualClockLoop``), so an engine step of 20 ms costs only its Python work. 10,000
  requests replay in seconds (``benchmarks/whatif_accuracy.py`` measures it).
- **The gateways** are the real routing code, called as the gateway calls it: eligibility
  (``routing.state.eligibility``), the policy's algorithm over a ``RoutingView`` (pure function), the
  approximate prefix index fed with the request's recorded prefix-hash chain
  (``RequestRecord.prefix_hashes``), and the in-flight book (``routing.state.inflight``, each
  request counted under its gateway's region). One gateway per region. One index serves every
  region (gateways share insertions within ~50 ms in production; here at once).
- **Sharing load** (``sharing_interval_s``): by default one book serves every region, so each
  gateway sees every peer's outstanding work the moment it changes (the replay's main optimism:
  gateways deciding on the same slightly old view of their peers herd, and that cannot happen
  here). With an interval, each gateway keeps its own book (its own work counts at once) and
  exchanges load as ``routing.state.sharing`` does: every ``sharing_interval_s`` (its period,
  ``LOAD_INTERVAL_S``; the gateways' phases spread evenly over it, so the replay stays
  deterministic) it writes its counts and reads its peers' last writes, through a store
  ``sharing_rtt_s`` away (the write lands half a round trip later, the answer a whole one; the
  next exchange starts an interval after the answer, one in flight at a time, as the gateway's
  loop does). ``sharing_rtt_s`` is one figure for every gateway or each region's own (a store in
  one region); a prefix update travels half its writer's round trip and half its reader's.
- **A request** leaves its gateway ``gateway_ms`` after arrival (as recorded), reaches the node
  half a round trip later (RTT from the table telemetry measured), and its first token reaches the
  client half a round trip after the engine produced it. Its prompt is rebuilt from the prefix
  hashes: each chunk hash becomes ``tokens_per_chunk`` token ids derived from it (equal chains give
  equal tokens, so the engine's prefix cache hits exactly where the real prompts shared text), then
  request-unique tokens up to the recorded prompt length. It decodes its recorded completion length.
- **Live state** (``num_running``/``num_waiting``, which gorgo's queue term reads) is refreshed
  from the engines every ``scrape_interval_s``, as the telemetry scrape does.

Never prompt text: the replay sees lengths, regions, times and hashes only.
"""

from __future__ import annotations

import asyncio
import math
import selectors
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from routing.algorithms import REGISTRY
from routing.algorithms.base import PrefixRent, RoutingRequest, RoutingView
from routing.cache.approx_index import CHUNK_BYTES, ApproxPrefixIndex
from routing.contract import (
    SCHEMA_VERSION,
    GatewayLoad,
    NodeLiveState,
    NodeSpec,
    PolicySnapshot,
    PrefixUpdate,
    RequestRecord,
    RTTTable,
)
from routing.state.eligibility import eligible_nodes
from routing.state.homing import HomingLedger
from routing.state.inflight import InFlight, Lease
from routing.state.sharing import PeerLoad, apply_peer_update, build_updates, load_report
from simulator.engine import (
    MAX_STEP_LAG_S,
    Engine,
    RequestStatus,
    SimRequest,
    TokenChannel,
    TokenEvent,
    _Scheduled,
)
from simulator.metrics import NodeMetrics
from simulator.topology import EngineParams

DEFAULT_SCRAPE_INTERVAL_S = 5.0
# A replay is stopped (and says so) past this much wall time: the API promises an answer.
DEFAULT_WALL_BUDGET_S = 60.0
# After the last arrival the fleet gets this much virtual time to finish; later first tokens count
# as not served (a policy that piles everything on one node shows up as such, not as a hang).
DRAIN_S = 600.0
_DEFAULTS = EngineParams()


class ReplayTooSlow(RuntimeError):
    """The replay used up its wall-clock budget before the fleet finished."""


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One recorded request, as much of it as the replay needs (no prompt text)."""

    arrival_s: float  # seconds after the window's start
    gateway_region: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    prefix_hashes: tuple[int, ...] = ()  # the gateway's chained chunk hashes of the prompt
    prompt_chars: int = 0
    gateway_ms: float = 0.0  # time in the gateway before the request left (as recorded)
    session_key: str | None = None


@dataclass(frozen=True, slots=True)
class ReplayedRequest:
    """What the replay predicts for one request; ``ttft_ms`` is None when nothing served it."""

    node_id: int | None
    cross_region: bool
    ttft_ms: float | None
    predicted_ms: float | None  # the algorithm's own cost estimate for the chosen node, if any


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    """Every request's prediction, in input order, and what the replay cost."""

    requests: tuple[ReplayedRequest, ...]
    wall_s: float
    virtual_s: float
    unroutable: int  # no eligible node (residency, max RTT, nothing serves the model)
    unfinished: int  # routed, but no first token within DRAIN_S after the last arrival

    def ttfts_ms(self) -> list[float]:
        return [r.ttft_ms for r in self.requests if r.ttft_ms is not None]


class _InstantSelector(selectors.DefaultSelector):
    """A selector whose wait moves the virtual clock forward instead of blocking."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualClockLoop | None = None

    def select(self, timeout: float | None = None):  # type: ignore[override]
        ready = super().select(0)
        if ready or self.loop is None:
            return ready
        if timeout is None:
            # Nothing scheduled and nothing ready: in a replay that is a bug, not a wait.
            raise RuntimeError("virtual-clock loop has nothing left to wait for")
        if timeout > 0:
            self.loop.virtual_now += timeout
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on a virtual clock: idle time is skipped, not slept.

    Timers fire in order at their virtual times, so code written for the real loop (the
    emulated engine's step loop) runs unchanged, as fast as its Python work allows.
    """

    def __init__(self) -> None:
        selector = _InstantSelector()
        super().__init__(selector)
        selector.loop = self
        self.virtual_now = 0.0

    def time(self) -> float:
        return self.virtual_now


class _FirstTokenChannel(TokenChannel):
    """Replaces a request's token channel: reports the first and last token, keeps nothing."""

    __slots__ = ("_on_first", "_on_last", "_seen_first")

    def __init__(self, on_first: Callable[[float], None], on_last: Callable[[float], None]) -> None:
        super().__init__()
        self._on_first = on_first
        self._on_last = on_last
        self._seen_first = False

    def push(self, event: TokenEvent) -> None:
        if not self._seen_first:
            self._seen_first = True
            self._on_first(event.at_s)
        if event.finish_reason is not None:
            self._on_last(event.at_s)


# Generated tokens never match a later prompt in a replay (prompts are rebuilt from their hashes),
# so every answer token gets one id: no text to sample, no vocabulary lookup.
_ANSWER_TOKEN_ID = 0
_ANSWER_EVENT_TEXT = ""


class ReplayEngine(Engine):
    """The emulated engine, lean for virtual time: same scheduler and KV cache, fewer steps.

    Differences from ``Engine`` (each only removes work a replay does not need):

    - a run of steps in which every running request is decoding and nothing waits is taken as one
      "macro step" of k identical steps (k up to the first request to finish), cut short at the next
      step boundary when a request arrives; the engine would have run the same k steps;
    - no Prometheus metrics and no answer text: a replay reads first-token times only.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._arrival: asyncio.Future[None] | None = None
        self.macro_steps = 0

    def add_request(self, *args: object, **kwargs: object) -> SimRequest:  # type: ignore[override]
        request = super().add_request(*args, **kwargs)  # type: ignore[arg-type]
        waiter = self._arrival
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return request

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        step_start = loop.time()
        while True:
            if not self.running and not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                step_start = loop.time()
            batch = self._schedule()
            if not batch:
                self._wakeup.clear()
                await self._wakeup.wait()
                step_start = loop.time()
                continue
            step_s = self._step_duration_s(batch)
            steps = self._decode_run_length(batch)
            if steps > 1:
                steps = await self._macro_sleep(loop, batch, step_start, step_s, steps)
            else:
                steps = 1
                await asyncio.sleep(max(0.0, step_start + step_s - loop.time()))
            step_end = step_start + steps * step_s
            now = loop.time()
            if steps > 1:
                self._complete_decode_steps(batch, steps, step_end)
            else:
                self._complete_step(batch, step_end)
            self.steps += steps
            step_start = step_end if now - step_end < MAX_STEP_LAG_S else now

    def _decode_run_length(self, batch: list[_Scheduled]) -> int:
        """How many identical all-decode steps may follow (1: this step is not one of those)."""
        if self.waiting or len(batch) != len(self.running):
            return 1
        steps = 1 << 30
        for item in batch:
            if not item.is_decode:
                return 1
            request = item.request
            steps = min(steps, request.stop_after_tokens - request.num_output_tokens)
        if steps <= 1:
            return 1
        # Every request needs KV slots for its next ``steps`` tokens; short of blocks, step singly.
        block_size = self.params.block_size
        needed = 0
        for item in batch:
            request = item.request
            # A macro step cut short leaves blocks for tokens not decoded yet: one request's
            # surplus is no other's supply.
            needed += max(
                0, math.ceil((request.num_computed_tokens + steps) / block_size) - len(request.blocks)
            )
        if needed > self.pool.num_free_blocks:
            return 1
        for item in batch:
            request = item.request
            want = math.ceil((request.num_computed_tokens + steps) / block_size) - len(request.blocks)
            if want > 0:
                fresh = self.pool.allocate(want)
                assert fresh is not None  # counted above
                request.blocks.extend(fresh)
        return steps

    async def _macro_sleep(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[_Scheduled],
        start_s: float,
        step_s: float,
        steps: int,
    ) -> int:
        """Sleep through ``steps`` steps, or to the end of the step in which a request arrives."""
        waiter = self._arrival = loop.create_future()
        timer = loop.call_at(start_s + steps * step_s, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._arrival = None
        now = loop.time()
        if step_s <= 0:
            return steps
        done = min(steps, max(1, math.ceil((now - start_s) / step_s - 1e-9)))
        end_s = start_s + done * step_s
        if end_s > now:
            await asyncio.sleep(end_s - now)
        return done

    def _complete_step(self, batch: list[_Scheduled], now: float) -> None:
        for item in batch:
            request = item.request
            if request.finished:
                continue
            request.num_computed_tokens += item.num_new_tokens  # its blocks cached when scheduled
            if request.num_computed_tokens < len(request.token_ids):
                continue
            request.token_ids.append(_ANSWER_TOKEN_ID)
            request.num_output_tokens += 1
            if request.first_token_s is None:
                request.first_token_s = now
            request.last_token_s = now
            if request.num_output_tokens >= request.stop_after_tokens:
                request.channel.push(TokenEvent(_ANSWER_EVENT_TEXT, now, "length"))
                self.running.remove(request)
                self._finish(request, "length", now)
            elif request.num_output_tokens == 1:
                request.channel.push(TokenEvent(_ANSWER_EVENT_TEXT, now))

    def _complete_decode_steps(self, batch: list[_Scheduled], steps: int, now: float) -> None:
        """``steps`` decode steps at once: each request gains ``steps`` tokens (none finishes early)."""
        answer = [_ANSWER_TOKEN_ID] * steps
        for item in batch:
            request = item.request
            if request.finished:
                continue
            request.num_computed_tokens += steps
            request.token_ids.extend(answer)
            request.num_output_tokens += steps
            request.last_token_s = now
            self._publish_full_blocks(request, 0)  # the blocks these decode steps filled
            if request.num_output_tokens >= request.stop_after_tokens:
                request.channel.push(TokenEvent(_ANSWER_EVENT_TEXT, now, "length"))
                self.running.remove(request)
                self._finish(request, "length", now)

    def _finish(self, request: SimRequest, reason: str, now: float) -> None:
        self.pool.release(request.blocks)
        request.blocks = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def engine_params(node: NodeSpec, block_size: int) -> EngineParams:
    """The emulated engine for a node: its spec's speed and sizes, the emulator's step costs."""
    kv_blocks = max(1, node.kv_capacity_tokens // block_size)
    return EngineParams(
        block_size=block_size,
        kv_capacity_blocks=kv_blocks,
        max_model_len=min(_DEFAULTS.max_model_len, kv_blocks * block_size),
        max_num_seqs=node.max_num_seqs,
        prefill_tokens_per_s=node.prefill_tokens_per_s,
    )


def rebuild_prompt(
    request: ReplayRequest, tokens_per_chunk: int, unique_base: int, chunk_tokens: dict[int, list[int]]
) -> list[int]:
    """Token ids standing in for the prompt: shared where the hash chains are shared, unique after."""
    tokens: list[int] = []
    for chunk_hash in request.prefix_hashes:
        if len(tokens) >= request.prompt_tokens:
            break
        ids = chunk_tokens.get(chunk_hash)
        if ids is None:
            start = chunk_hash & 0x3FFF_FFFF
            ids = chunk_tokens[chunk_hash] = [
                (start + 7919 * j) & 0x7FFF_FFFF for j in range(tokens_per_chunk)
            ]
        tokens.extend(ids)
    del tokens[max(1, request.prompt_tokens) :]
    missing = max(1, request.prompt_tokens) - len(tokens)
    if missing > 0:
        # Above every derived id (< 2**31) and distinct per request: never a false cache hit.
        tokens.extend(range(unique_base, unique_base + missing))
    return tokens


def prompt_block_hashes(
    request: ReplayRequest, tokens_per_chunk: int, unique_base: int, block_size: int, num_tokens: int
) -> list[int]:
    """The KV block hashes of a rebuilt prompt, without hashing its tokens.

    A block inside the chunk-derived part is named by (the hash of the chunk holding its last
    token, its index): that chunk hash covers the whole prefix up to there, so equal names mean equal
    prefixes, which is all the engine's cache needs. Blocks that reach the request's own tokens
    are named by the request. Hashing every block's tokens instead cost most of a replay's time.
    """
    derived = min(len(request.prefix_hashes) * tokens_per_chunk, num_tokens)
    hashes = request.prefix_hashes
    names: list[int] = []
    for index in range(num_tokens // block_size):
        end = (index + 1) * block_size
        owner = hashes[(end - 1) // tokens_per_chunk] if end <= derived else unique_base
        names.append(hash((owner, index)) & _HASH_MASK)
    return names


_HASH_MASK = (1 << 64) - 1  # block hashes are unsigned 64-bit, as the engine's own


def _unique_base(position: int) -> int:
    """Where a request's own tokens start: above every derived id, spread so tails never align."""
    return 2**31 + (position * 2_654_435_761) % 2**30


def tokens_per_chunk_of(requests: Sequence[ReplayRequest]) -> int:
    """Tokens a prefix chunk stands for: CHUNK_BYTES at the window's measured chars per token."""
    chars = sum(r.prompt_chars for r in requests if r.prompt_chars and r.prompt_tokens)
    tokens = sum(r.prompt_tokens for r in requests if r.prompt_chars and r.prompt_tokens)
    chars_per_token = chars / tokens if chars and tokens else 4.0
    return max(1, round(CHUNK_BYTES / chars_per_token))


def replay(
    snapshot: PolicySnapshot,
    rtt_ms: Mapping[tuple[str, int], float],
    requests: Sequence[ReplayRequest],
    *,
    scrape_interval_s: float | None = DEFAULT_SCRAPE_INTERVAL_S,
    wall_budget_s: float = DEFAULT_WALL_BUDGET_S,
    clock: Callable[[], float] = time.perf_counter,
    sharing_interval_s: float | None = None,
    sharing_rtt_s: float | Mapping[str, float] = 0.0,
    prefix_interval_s: float = 0.0,
    peer_claims: bool = True,
) -> ReplayOutcome:
    """Route ``requests`` (sorted by arrival) with ``snapshot``'s policy on its emulated fleet.

    ``rtt_ms``: (gateway region, node id) -> round trip; a missing pair costs the policy's
    ``default_rtt_ms`` if it has one, else 100 ms. ``scrape_interval_s`` None: no live state (a
    fleet without telemetry workers). ``sharing_interval_s`` None (or 0): gateways see each
    other's load at once; else they exchange it every that many seconds, through a store
    ``sharing_rtt_s`` away (module docstring): one figure for every gateway, or region -> its
    round trip (a store in one region). Raises ``ReplayTooSlow`` past ``wall_budget_s``.
    """
    loop = VirtualClockLoop()
    sharing = (
        _Sharing(sharing_interval_s, sharing_rtt_s, prefix_interval_s, peer_claims)
        if sharing_interval_s
        else None
    )
    try:
        return loop.run_until_complete(
            _Replay(snapshot, rtt_ms, requests, scrape_interval_s, wall_budget_s, clock, sharing).run()
        )
    finally:
        loop.close()


@dataclass(frozen=True, slots=True)
class _Sharing:
    """How gateways exchange load (every ``interval_s``, through a store ``rtt_s`` away) and prefix
    insertions (every ``prefix_interval_s``; 0: one index for all, updated at once)."""

    interval_s: float
    rtt_s: float | Mapping[str, float]  # every gateway's, or region -> its round trip to the store
    prefix_interval_s: float
    claims: bool = True  # False: the gateways before claims (issue 24), insertions only


class _Replay:
    """One replay's state: the engines, the shared gateway state and the per-request results."""

    def __init__(
        self,
        snapshot: PolicySnapshot,
        rtt_ms: Mapping[tuple[str, int], float],
        requests: Sequence[ReplayRequest],
        scrape_interval_s: float | None,
        wall_budget_s: float,
        clock: Callable[[], float],
        sharing: _Sharing | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.algorithm = REGISTRY[snapshot.policy.algorithm]
        self.requests = requests
        self.scrape_interval_s = scrape_interval_s
        self.wall_budget_s = wall_budget_s
        self.clock = clock
        self.default_rtt_ms = float(getattr(snapshot.policy.params, "default_rtt_ms", 100.0))
        self.rtt_ms = dict(rtt_ms)
        self.rtt_by_region: dict[str, dict[int, float]] = {}
        for (region, node_id), value in rtt_ms.items():
            self.rtt_by_region.setdefault(region, {})[node_id] = value
        self.nodes = {node.id: node for node in snapshot.nodes}
        node_regions = {node.id: node.region for node in snapshot.nodes}
        self.inflight = InFlight()  # instant sharing: one book for every gateway
        self.inflight.set_node_regions(node_regions)
        self.tokens_per_chunk = tokens_per_chunk_of(requests)
        self.index = self._new_index()  # instant sharing: one index for every gateway
        self.sharing = sharing
        # Delayed sharing: each gateway's own book, and what each last wrote to the shared store;
        # each gateway's own prefix index when insertions are shared every interval too.
        self.books: dict[str, InFlight] = {}
        self.reports: dict[str, GatewayLoad] = {}
        self.indexes: dict[str, ApproxPrefixIndex] = {}
        self.peers: dict[str, PeerLoad] = {}  # what each gateway knows of the others' load
        if sharing is not None:
            for region in sorted({request.gateway_region for request in requests}):
                book = self.books[region] = InFlight(region)
                book.set_node_regions(node_regions)
                self.peers[region] = PeerLoad()
                if sharing.prefix_interval_s:
                    self.indexes[region] = self._new_index()
        self.chunk_tokens: dict[int, list[int]] = {}
        self.live: dict[int, NodeLiveState] = {}
        self.candidates: dict[tuple[str, str], tuple[NodeSpec, ...]] = {}
        self.sequence: dict[str, int] = {}
        self.homing: dict[str, HomingLedger] = {}  # each gateway's (region's) rent for prefixes abroad
        self.results: list[ReplayedRequest | None] = [None] * len(requests)
        self.pending = 0
        self.unroutable = 0
        self.done: asyncio.Future[None] | None = None
        self.engines: dict[int, ReplayEngine] = {}

    def _new_index(self) -> ApproxPrefixIndex:
        index = ApproxPrefixIndex(clock=lambda: 0.0)  # every call passes its own time
        index.sync_nodes(self.snapshot.nodes)
        index.set_chars_per_token(CHUNK_BYTES / self.tokens_per_chunk)
        return index

    async def run(self) -> ReplayOutcome:
        loop = asyncio.get_running_loop()
        started = self.clock()
        block_sizes = {model.name: model.kv_block_size for model in self.snapshot.models}
        for node in self.snapshot.nodes:
            block_size = min((block_sizes.get(m, 16) for m in node.models), default=16)
            params = engine_params(node, block_size)
            metrics = NodeMetrics(
                node.name,
                max_model_len=params.max_model_len,
                block_size=params.block_size,
                num_gpu_blocks=params.kv_capacity_blocks,
            )
            engine = ReplayEngine(params, metrics)
            engine.start()
            assert engine._task is not None
            engine._task.add_done_callback(self._engine_stopped)
            self.engines[node.id] = engine
        if self.scrape_interval_s is not None:
            self._scrape()
        self.done = loop.create_future()
        self.pending = len(self.requests)
        for position, request in enumerate(self.requests):
            loop.call_at(request.arrival_s, self._arrive, position)
        last_arrival_s = max((r.arrival_s for r in self.requests), default=0.0)
        loop.call_at(last_arrival_s + DRAIN_S, self._give_up)
        scraper = loop.create_task(self._scrape_every()) if self.scrape_interval_s is not None else None
        exchanges = [
            loop.create_task(self._exchange_every(region, slot / len(self.books)))
            for slot, region in enumerate(self.books)
        ]
        exchanges += [
            loop.create_task(self._flush_prefixes_every(region, slot / len(self.indexes)))
            for slot, region in enumerate(self.indexes)
        ]
        watchdog = loop.create_task(self._watch_wall(started))
        if not self.requests:
            self.done.set_result(None)
        try:
            await self.done
        finally:
            if scraper is not None:
                scraper.cancel()
            for exchange in exchanges:
                exchange.cancel()
            watchdog.cancel()
            for engine in self.engines.values():
                await engine.stop()
        unfinished = 0
        results: list[ReplayedRequest] = []
        for result in self.results:
            if result is None:  # routed but never reached a first token
                unfinished += 1
                result = ReplayedRequest(None, False, None, None)
            results.append(result)
        return ReplayOutcome(
            requests=tuple(results),
            wall_s=self.clock() - started,
            virtual_s=loop.time(),
            unroutable=self.unroutable,
            unfinished=unfinished,
        )

    # ---- gateway side ----------------------------------------------------------------------------

    def _candidates(self, model: str, region: str) -> tuple[NodeSpec, ...]:
        key = (model, region)
        found = self.candidates.get(key)
        if found is None:
            found, _excluded = eligible_nodes(
                self.snapshot, model, region, {}, self.rtt_by_region.get(region, {})
            )
            self.candidates[key] = found
        return found

    def _rtt(self, region: str, node_id: int) -> float:
        return self.rtt_ms.get((region, node_id), self.default_rtt_ms)

    def _arrive(self, position: int) -> None:
        loop = asyncio.get_running_loop()
        request = self.requests[position]
        candidates = self._candidates(request.model, request.gateway_region)
        if not candidates:
            self.unroutable += 1
            self.results[position] = ReplayedRequest(None, False, None, None)
            self._settled()
            return
        now = loop.time()
        node_ids = tuple(node.id for node in candidates)
        uses_index = self.algorithm.needs_prefix_matches
        region = request.gateway_region
        index = self.indexes.get(region, self.index)
        matched = index.match_hashes(request.prefix_hashes, node_ids, now) if uses_index else {}
        self.sequence[region] = sequence = self.sequence.get(region, 0) + 1
        book = self.books.get(region, self.inflight)
        homing = self.homing.get(region)
        if homing is None:
            homing = self.homing[region] = HomingLedger()
        homing.fade_to(now)
        view = RoutingView(
            region,
            candidates,
            self.snapshot.policy.params,
            book.load_view(),
            self.rtt_by_region.get(region, {}),
            self.live,
            matched,
            sequence,
            f"replay-{region}",
            PrefixRent(request.prefix_hashes, self.tokens_per_chunk, homing.owed) if uses_index else None,
        )
        routed = RoutingRequest(
            request.model, request.prompt_chars, request.prompt_tokens, request.session_key
        )
        decision = self.algorithm.choose(view, routed)
        node = decision.node
        if decision.rent_keys:
            if decision.homed:
                homing.settle(decision.rent_keys)
            else:
                homing.pay(decision.rent_keys, decision.rent_ms)
        if uses_index:
            index.insert_hashes(node.id, request.prefix_hashes, now)
        cost = decision.cost
        prefill_tokens = (
            cost.uncached_tokens if cost is not None and cost.node_id == node.id else request.prompt_tokens
        )
        lease = book.begin(node.id, prefill_tokens, region)
        rtt_ms = self._rtt(region, node.id)
        predicted = cost.total_ms if cost is not None and cost.node_id == node.id else None
        sent_s = now + request.gateway_ms / 1000.0
        loop.call_at(
            sent_s + rtt_ms / 2000.0,
            self._reach_node,
            position,
            node,
            lease,
            rtt_ms,
            predicted,
            matched.get(node.id, 0),
        )

    def _reach_node(
        self,
        position: int,
        node: NodeSpec,
        lease: Lease,
        rtt_ms: float,
        predicted: float | None,
        matched: int,
    ) -> None:
        loop = asyncio.get_running_loop()
        request = self.requests[position]
        engine = self.engines[node.id]
        unique_base = _unique_base(position)
        tokens = rebuild_prompt(request, self.tokens_per_chunk, unique_base, self.chunk_tokens)
        tokens = tokens[: engine.params.max_model_len - 1]
        max_tokens = max(1, min(request.completion_tokens, engine.params.max_model_len - len(tokens)))
        sim = engine.add_request(str(position), tokens, max_tokens, ignore_eos=True)
        sim.block_hashes.extend(
            prompt_block_hashes(
                request, self.tokens_per_chunk, unique_base, engine.params.block_size, len(tokens)
            )
        )
        half_rtt_s = rtt_ms / 2000.0
        arrival_s = request.arrival_s

        def first_token(at_s: float) -> None:
            ttft_ms = (at_s + half_rtt_s - arrival_s) * 1000.0
            cross = node.region != request.gateway_region
            self.results[position] = ReplayedRequest(node.id, cross, ttft_ms, predicted)
            loop.call_at(at_s + half_rtt_s, lease.first_byte)
            self._observe_cache(node.id, matched, request, sim, at_s)

        def last_token(at_s: float) -> None:
            loop.call_at(at_s + half_rtt_s, self._finished, lease)

        sim.channel = _FirstTokenChannel(first_token, last_token)

    def _observe_cache(
        self, node_id: int, matched: int, request: ReplayRequest, sim: SimRequest, now: float
    ) -> None:
        # The gateway feeds back predicted vs real hits so a thrashing node loses its credit.
        if not self.algorithm.needs_prefix_matches or not request.prompt_tokens:
            return
        cached = sim.num_cached_tokens or 0
        index = self.indexes.get(request.gateway_region, self.index)
        index.observe(node_id, matched / request.prompt_tokens, cached / sim.num_prompt_tokens, now)

    def _finished(self, lease: Lease) -> None:
        lease.release()
        self._settled()

    def _settled(self) -> None:
        self.pending -= 1
        if self.pending <= 0 and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _engine_stopped(self, task: asyncio.Task[None]) -> None:
        # An engine only stops on its own when it crashed: the replay must say so, not hang.
        if task.cancelled() or self.done is None or self.done.done():
            return
        error = task.exception()
        if error is not None:
            self.done.set_exception(error)

    def _give_up(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    # ---- load sharing between gateways (delayed) -----------------------------------------------

    def _store_rtt_s(self, region: str) -> float:
        assert self.sharing is not None
        rtt_s = self.sharing.rtt_s
        return rtt_s if isinstance(rtt_s, float | int) else rtt_s.get(region, 0.0)

    async def _exchange_every(self, region: str, phase: float) -> None:
        """One gateway's load exchange, as ``GatewaySharing``'s: one round trip, then the interval,
        from its phase on."""
        assert self.sharing is not None
        interval_s = self.sharing.interval_s
        await asyncio.sleep(phase * interval_s)
        while True:
            self._exchange(region)
            await asyncio.sleep(self._store_rtt_s(region) + interval_s)

    def _exchange(self, region: str) -> None:
        """Write this gateway's counts and read its peers' latest (one round trip to the store)."""
        assert self.sharing is not None
        loop = asyncio.get_running_loop()
        book = self.books[region]
        report = load_report(
            f"replay-{region}",
            region,
            loop.time(),
            (
                book.outstanding_requests(),
                book.outstanding_prefill_tokens(),
                book.home_requests(),
                book.outstanding_context_tokens(),
            ),
        )
        half_rtt_s = self._store_rtt_s(region) / 2.0
        if half_rtt_s > 0:
            loop.call_later(half_rtt_s, self._write_and_read, region, report, half_rtt_s)
        else:
            self._write_and_read(region, report, 0.0)

    async def _flush_prefixes_every(self, region: str, phase: float) -> None:
        """One gateway's prefix publisher: its new insertions reach its peers every interval, a
        round trip to the store later (half to write, half for the peers' blocking reads, which
        return as entries arrive); each peer applies them to its index and claims their work in
        its view of the peers' load."""
        assert self.sharing is not None
        interval_s = self.sharing.prefix_interval_s
        own_rtt_s = self._store_rtt_s(region)
        loop = asyncio.get_running_loop()
        await asyncio.sleep(phase * interval_s)
        while True:
            updates = build_updates(f"replay-{region}", self.indexes[region].take_updates())
            if updates:
                for peer in self.indexes:
                    if peer == region:
                        continue
                    delay_s = (own_rtt_s + self._store_rtt_s(peer)) / 2.0
                    if delay_s > 0:
                        loop.call_later(delay_s, self._receive_prefixes, peer, updates)
                    else:
                        self._receive_prefixes(peer, updates)
            # The publisher waits for its XADD's answer before its next interval, as the gateway's.
            await asyncio.sleep(own_rtt_s + interval_s)

    def _receive_prefixes(self, region: str, updates: list[PrefixUpdate]) -> None:
        assert self.sharing is not None
        index = self.indexes[region]
        if not self.sharing.claims:
            for update in updates:
                index.apply_remote(update)
            return
        for update in updates:
            apply_peer_update(index, self.peers[region], update)
        self.books[region].set_peer_load(self.peers[region].load())

    def _write_and_read(self, region: str, report: GatewayLoad, half_rtt_s: float) -> None:
        self.reports[region] = report
        seen = [load for peer, load in self.reports.items() if peer != region]
        if half_rtt_s > 0:
            asyncio.get_running_loop().call_later(half_rtt_s, self._read, region, seen)
        else:
            self._read(region, seen)

    def _read(self, region: str, seen: list[GatewayLoad]) -> None:
        """The peers' reports reach this gateway."""
        peers = self.peers[region]
        peers.read_reports(seen)
        self.books[region].set_peer_load(peers.load())

    # ---- telemetry side --------------------------------------------------------------------------

    def _scrape(self) -> None:
        now = asyncio.get_running_loop().time()
        self.live = {
            node_id: NodeLiveState(
                schema_version=SCHEMA_VERSION,
                node_id=node_id,
                healthy=True,
                updated_at=now,
                num_running=float(len(engine.running)),
                num_waiting=float(len(engine.waiting)),
                kv_cache_usage=engine.pool.usage,
                last_scrape_at=now,
            )
            for node_id, engine in self.engines.items()
        }

    async def _scrape_every(self) -> None:
        assert self.scrape_interval_s is not None
        while True:
            await asyncio.sleep(self.scrape_interval_s)
            self._scrape()

    async def _watch_wall(self, started: float) -> None:
        # Checked between engine steps (every few ms of virtual time): a slow replay is stopped.
        while True:
            await asyncio.sleep(0.5)
            if self.clock() - started > self.wall_budget_s:
                if self.done is not None and not self.done.done():
                    self.done.set_exception(
                        ReplayTooSlow(f"the replay took more than {self.wall_budget_s:g} s of wall time")
                    )
                return


def replayable(record: RequestRecord) -> bool:
    """Requests that reached routing: not the client's own mistakes (4xx), not unrouted errors."""
    if 400 <= record.status < 500:
        return False
    return record.node_id is not None and (record.prompt_tokens or record.prompt_tokens_est) > 0


def to_replay_requests(records: Sequence[RequestRecord]) -> list[ReplayRequest]:
    """Replay inputs from request-log records (arrival order; times from the first arrival)."""
    chosen = sorted((r for r in records if replayable(r)), key=lambda r: r.ts)
    if not chosen:
        return []
    start = chosen[0].ts
    return [
        ReplayRequest(
            arrival_s=r.ts - start,
            gateway_region=r.gateway_region,
            model=r.model,
            prompt_tokens=r.prompt_tokens or r.prompt_tokens_est,
            completion_tokens=max(1, r.completion_tokens or 1),
            prefix_hashes=r.prefix_hashes,
            prompt_chars=r.prompt_chars,
            gateway_ms=r.gateway_ms,
        )
        for r in chosen
    ]


def rtt_pairs(table: RTTTable | None) -> dict[tuple[str, int], float]:
    """(region, node id) -> measured RTT (ms) from telemetry's table."""
    if table is None:
        return {}
    return {(entry.region, entry.node_id): entry.rtt_ms for entry in table.entries}


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not sorted_values:
        return None
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)
