"""GORGO: send each request where its estimated time to first token is lowest.

For every candidate node n (docs/routing.md has the derivation and the defaults)::

    ttft_ms(n) = w_rtt * rtt_ms(n) + w_queue * queue_ms(n) + prefill_ms(n) + displacement_ms(n)
    prefill_ms(n) = uncached_tokens(n) / prefill_tokens_per_s(n) * 1000
    uncached_tokens(n) = prompt_tokens_est - matched_tokens(n)
    queue_ms(n) = (outstanding_prefill_tokens(n) * (1 + s(n)) + uncached_tokens(n) * s(n))
                  / prefill_tokens_per_s(n) * 1000 + kv_wait_ms(n)
    s(n) = DECODE_SLOWDOWN_AT_FULL_BATCH * running(n) / max_num_seqs(n)

- ``rtt_ms``: the measured round trip from this gateway's region (``params.default_rtt_ms`` when
  there is no measurement yet). One round trip: the request goes out, the first token comes back.
- ``outstanding_prefill_tokens``: prompt tokens this gateway and its peers sent to n that have not
  produced a first token yet (prefill still ahead of a new request in vLLM's FCFS queue).
- ``kv_wait_ms`` (in the queue term): when this prompt's uncached tokens do not fit in n's KV cache
  (``kv_capacity_tokens``) beside the prompt tokens its outstanding requests hold until they finish
  (``outstanding_context_tokens``), vLLM admits it only as they free blocks: the excess over the
  rate they drain at (held tokens per ``RESIDENCE_MS``). Long answers keep a node's cache full
  while its prefill queue is empty; without this term such a node looked idle (mixed-length).
- ``running``: sequences on n: the larger of the requests the gateways have outstanding there and
  the node's scraped ``num_running + num_waiting`` (traffic that did not come through gorgo).
  Every running sequence takes a slice of each engine step, so prefill runs slower on a busy node;
  ``s`` models that as a proportional slowdown, charged to the queue term.
- ``matched_tokens``: what the prefix index believes n holds of this prompt.
- ``displacement_ms`` (coordinated overflow; ``w_displacement = 0`` is greedy): 0 for the
  gateway's own region; for a node in another region, the wait this request adds for that
  region's own requests arriving while it holds the node, *beyond* the wait it would add for its
  own region's requests by staying at home (it is priced only when a forward costs the receiving
  region more than staying costs the sender's: an overloaded region's overflow displaces its own
  clients wherever it waits, so holding it at home protects nobody and only lengthens its tail).
  At a node, that wait is the node's own region's arrival rate times this request's time there
  (queue + prefill) times what each waits (half its prefill, or all of it when it joins a queue).
  The rate is Little's law over the requests of the node's own region outstanding there
  (``NodeLoad.home_requests``; imported requests are not that region's arrivals) and the time a
  request actually stays (``RESIDENCE_MS`` of decoding + the node's queue + prefill). The
  measurements (docs/routing.md): counting imports and a fixed residence priced a forward by the
  square of the receiving queue, and no home price kept an overloaded region's overflow at home;
  both put the diurnal workload's p99 at twice the greedy policy's. An imported request is usually a
  cache miss there (another region's prompts), so its prefill is long and the receiving region's
  cheap cache hits queue behind it; docs/routing.md has the measurements.

The cheapest node wins. Costs within ``TIE_BAND_REL`` (+``TIE_BAND_MS``) of the cheapest are
ties (the estimate is not more precise than that). Between two tied nodes the lower load wins
(outstanding requests, then prefill tokens); among three or more, the lower load of two of them
drawn by (gateway id, request counter).

Guards (each with a test that fails without it; docs/routing.md explains the mechanisms):

- capacity: a node with ``outstanding_requests >= max_num_seqs * CAPACITY_FACTOR`` is skipped
  while some node has room (past that, vLLM queues requests behind whole decodes, a wait this cost
  model does not see).
- hot prefix (vLLM production-stack #957): a node carrying more than ``HOT_LOAD_FACTOR`` times
  the mean outstanding requests of the other candidates *in its region*
  (+``HOT_LOAD_SLACK_REQUESTS``) gets no cache credit, so a hot prefix spills to, and gets cached
  on, another node instead of pinning all its traffic to one (consistent hashing with bounded
  loads, applied to cache affinity). Only its own region counts: replicating a prefix next door
  costs a millisecond, while a region that is simply busier than the others (more clients, fewer
  nodes) is not a hot prefix, and its spill abroad is the RTT and queue terms' decision.
- miss snowball (SGLang "death spiral"): misses are placed by RTT and queue, never by cache size;
  the returned ``uncached_tokens`` is what the gateway should count as the request's outstanding
  prefill; and the prefix index scales a node's credit by how many of its predicted hits were real
  (``ApproxPrefixIndex.observe``), so a thrashing node stops attracting "hits" that are misses.
- herding (Dynamo #589): peer gateways' outstanding work is in the load view (``routing.state.sharing``);
  near-equal nodes count as ties and wider ties are split by two random choices per gateway, so
  gateways deciding on the same slightly stale view spread instead of all picking the same node.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import lru_cache

from routing.algorithms.base import AlgorithmInfo, Decision, NodeLoad, RoutingRequest, RoutingView
from routing.contract import CostTerms, GorgoParams, NodeSpec

CAPACITY_FACTOR = 1.0
# At a full batch (running == max_num_seqs) a prefill takes this much longer again. vLLM steps mix
# prefill chunks with one token per decoding sequence; the decode share of a step grows with the
# batch. 0.25 matches the emulated H100 engine (6.5 ms + 0.06 ms per decoding sequence per step).
DECODE_SLOWDOWN_AT_FULL_BATCH = 0.25
HOT_LOAD_FACTOR = 2.0
HOT_LOAD_SLACK_REQUESTS = 4
TIE_BAND_REL = 0.05
TIE_BAND_MS = 2.0
# How long a request decodes on a node (~128 tokens at ~7 ms a step); with the node's queue and its
# prefill, how long it stays there: turns the requests outstanding there into their arrival rate
# (Little's law) for the displacement term.
RESIDENCE_MS = 1000.0

_DEFAULT_PARAMS = GorgoParams()
_NO_LOAD = NodeLoad()


@dataclass(frozen=True, slots=True)
class Guards:
    """Which guards run; all of them in production. Tests switch one off to show what it prevents."""

    capacity: bool = True
    hot_prefix: bool = True
    spread_ties: bool = True


ALL_GUARDS = Guards()


def choose(view: RoutingView, request: RoutingRequest) -> Decision:
    """Pick the node with the lowest estimated TTFT; the winner's and runner-up's terms come back."""
    return choose_guarded(view, request, ALL_GUARDS)


def choose_guarded(view: RoutingView, request: RoutingRequest, guards: Guards) -> Decision:
    """``choose`` with an explicit set of guards."""
    params = view.params if isinstance(view.params, GorgoParams) else _DEFAULT_PARAMS
    rows = _rows(view, request, guards, params, False)
    return _decide(rows, guards, view)


def choose_twice(view: RoutingView, request: RoutingRequest, other: GorgoParams) -> tuple[Decision, Decision]:
    """``choose`` under the view's parameters and under ``other``, which may differ only in weights.

    A shadow that moves gorgo's weights (issue 23) decides on the same per-node terms (RTT, queue,
    prefill, the displacement's factor), which do not depend on the weights: they are computed
    once and only the totals are weighed again, so the shadow costs a pick, not a decision.
    ``other.default_rtt_ms`` must be the view's (it changes a term, not a weight).
    """
    params = view.params if isinstance(view.params, GorgoParams) else _DEFAULT_PARAMS
    rows = _rows(view, request, ALL_GUARDS, params, True)
    w_rtt, w_queue, w_displacement = other.w_rtt, other.w_queue, other.w_displacement
    reweighed = [
        (
            w_rtt * row[_RTT]
            + w_queue * row[_QUEUE]
            + row[_PREFILL]
            + w_displacement * row[_DISPLACEMENT_FACTOR],
            *row[1:_DISPLACEMENT],
            w_displacement * row[_DISPLACEMENT_FACTOR],
            row[_DISPLACEMENT_FACTOR],
        )
        for row in rows
    ]
    return _decide(rows, ALL_GUARDS, view), _decide(reweighed, ALL_GUARDS, view)


def _rows(
    view: RoutingView, request: RoutingRequest, guards: Guards, params: GorgoParams, keep_factor: bool
) -> list[_Row]:
    """Every candidate's valuation under ``params``; ``keep_factor``: compute the displacement's
    factor even when ``w_displacement`` is 0 (``choose_twice`` weighs it again)."""
    w_rtt = params.w_rtt
    w_queue = params.w_queue
    w_displacement = params.w_displacement
    home = view.region
    default_rtt_ms = params.default_rtt_ms
    prompt_tokens = max(0, request.prompt_tokens_est)
    candidates = view.candidates
    load_of = view.load.get
    rtt_of = view.rtt_ms.get
    live_of = view.live.get
    matched_map = view.matched_tokens
    matched_of = matched_map.get

    # Per region: (outstanding requests, candidates), for the hot-prefix guard.
    region_load: dict[str, list[int]] | None = None
    if guards.hot_prefix and matched_map and len(candidates) > 1:
        region_load = {}
        for node in candidates:
            entry = region_load.setdefault(node.region, [0, 0])
            entry[0] += load_of(node.id, _NO_LOAD).outstanding_requests
            entry[1] += 1

    rows: list[_Row] = []
    capacity_guard = guards.capacity
    any_live = bool(view.live)
    for node in candidates:
        node_id = node.id
        load = load_of(node_id, _NO_LOAD)
        requests = load.outstanding_requests
        running = requests
        if any_live:
            live = live_of(node_id)
            if live is not None and live.num_running is not None:
                scraped = live.num_running + (live.num_waiting or 0.0)
                if scraped > running:
                    running = scraped
        max_seqs = node.max_num_seqs
        if max_seqs < 1:
            max_seqs = 1
        full = capacity_guard and requests >= max_seqs * CAPACITY_FACTOR

        matched = matched_of(node_id, 0)
        if matched:
            if matched > prompt_tokens:
                matched = prompt_tokens
            if region_load is not None:
                region_requests, region_nodes = region_load[node.region]
                if (
                    region_nodes > 1
                    and requests
                    > HOT_LOAD_FACTOR * (region_requests - requests) / (region_nodes - 1)
                    + HOT_LOAD_SLACK_REQUESTS
                ):
                    matched = 0  # too hot to be credited for its cache: let the prefix spread
        uncached = prompt_tokens - matched

        rate = node.prefill_tokens_per_s
        ms_per_token = 1000.0 / rate if rate > 0 else 1000.0
        slowdown = DECODE_SLOWDOWN_AT_FULL_BATCH * running / max_seqs
        prefill_tokens = load.outstanding_prefill_tokens
        queue_ms = (prefill_tokens * (1.0 + slowdown) + uncached * slowdown) * ms_per_token
        held_tokens = load.outstanding_context_tokens
        kv_excess = held_tokens + uncached - node.kv_capacity_tokens
        if kv_excess > 0 and held_tokens:
            # The prompt does not fit beside what the outstanding requests hold: vLLM admits it
            # only as they finish and free their blocks, each after about a residence, so the
            # held tokens drain at held / RESIDENCE_MS per ms.
            queue_ms += kv_excess * RESIDENCE_MS / held_tokens
        prefill_ms = uncached * ms_per_token
        rtt_ms = rtt_of(node_id, default_rtt_ms)
        displacement_factor = 0.0
        own_requests = load.home_requests
        if (w_displacement or keep_factor) and own_requests:
            # The node's own region's requests that arrive while this one holds the node (Little:
            # theirs there now over how long one stays there, its queue included), each waiting
            # for half its prefill or for all of it when it joins a queue. At home too: staying
            # is the alternative a forward is priced against (below).
            arrivals_per_ms = own_requests / (RESIDENCE_MS + queue_ms + prefill_ms)
            displacement_factor = (
                arrivals_per_ms * (queue_ms + prefill_ms) * min(prefill_ms, queue_ms + prefill_ms / 2)
            )
        displacement_ms = w_displacement * displacement_factor
        rows.append(
            (
                w_rtt * rtt_ms + w_queue * queue_ms + prefill_ms + displacement_ms,
                requests,
                prefill_tokens,
                full,
                node,
                rtt_ms,
                queue_ms,
                prefill_ms,
                matched,
                uncached,
                displacement_ms,
                displacement_factor,
            )
        )
    if w_displacement or keep_factor:
        rows = _net_of_staying(rows, home)
    return rows


def _net_of_staying(rows: list[_Row], home: str) -> list[_Row]:
    """Each forward's displacement beyond what staying at home displaces; none at home.

    Staying costs the home region's own later arrivals the least any home node's factor says; a
    forward is charged only what it displaces above that (never a credit: a forward that
    displaces less than staying is left to the RTT, queue and prefill terms, as greedy routing
    would). With no home candidate (an outage) every option is a forward and pays its whole factor.
    """
    home_factors = [row[_DISPLACEMENT_FACTOR] for row in rows if row[_NODE].region == home]
    if not home_factors:
        return rows
    staying = min(home_factors)
    netted: list[_Row] = []
    for row in rows:
        raw = row[_DISPLACEMENT_FACTOR]
        factor = 0.0 if row[_NODE].region == home else max(0.0, raw - staying)
        weighted = row[_DISPLACEMENT] * factor / raw if raw else 0.0
        netted.append((row[_TOTAL] - row[_DISPLACEMENT] + weighted, *row[1:_DISPLACEMENT], weighted, factor))
    return netted


def _decide(rows: list[_Row], guards: Guards, view: RoutingView) -> Decision:
    """The cheapest row (ties spread), past the capacity guard; with the runner-up's terms."""
    has_room = not all(row[_FULL] for row in rows)
    pool = [row for row in rows if not row[_FULL]] if has_room and guards.capacity else rows
    winner = _pick(pool, guards.spread_ties, view)
    runner_up = None
    for row in pool if len(pool) > 1 else rows:
        if row is not winner and (runner_up is None or row[_TOTAL] < runner_up[_TOTAL]):
            runner_up = row
    return Decision(
        node=winner[_NODE],
        cost=_terms(winner),
        runner_up=_terms(runner_up) if runner_up is not None else None,
    )


# One candidate's valuation. A plain tuple: building 64 of them per decision is the hot loop, and
# a tuple costs a fraction of a class instance.
_Row = tuple[float, int, int, bool, NodeSpec, float, float, float, int, int, float, float]
_TOTAL, _REQUESTS, _PREFILL_TOKENS, _FULL, _NODE, _RTT, _QUEUE, _PREFILL = 0, 1, 2, 3, 4, 5, 6, 7
_DISPLACEMENT, _DISPLACEMENT_FACTOR = 10, 11


def _terms(row: _Row) -> CostTerms:
    total_ms, _, _, _, node, rtt_ms, queue_ms, prefill_ms, matched, uncached, displacement_ms, _ = row
    return CostTerms(
        node_id=node.id,
        total_ms=total_ms,
        rtt_ms=rtt_ms,
        queue_ms=queue_ms,
        prefill_ms=prefill_ms,
        matched_tokens=matched,
        uncached_tokens=uncached,
        displacement_ms=displacement_ms,
    )


def _pick(pool: list[_Row], spread_ties: bool, view: RoutingView) -> _Row:
    best_ms = min(row[_TOTAL] for row in pool)
    if not spread_ties:
        tied = [row for row in pool if row[_TOTAL] == best_ms]
        return min(tied, key=_load_key)
    limit_ms = best_ms + best_ms * TIE_BAND_REL + TIE_BAND_MS
    tied = [row for row in pool if row[_TOTAL] <= limit_ms]
    count = len(tied)
    if count <= 2:
        return min(tied, key=_load_key)
    # Power of two choices: the lighter of two tied nodes drawn by (gateway, request counter).
    # Always taking the lightest node herds every gateway that shares a stale view onto it;
    # two random choices keep the balance and make those gateways disagree.
    draw = _mix(_gateway_seed(view.gateway_id) + view.sequence)
    first = draw % count
    second = (first + 1 + (draw >> 32) % (count - 1)) % count
    return min(tied[first], tied[second], key=_load_key)


def _load_key(row: _Row) -> tuple[int, int, float]:
    return row[_REQUESTS], row[_PREFILL_TOKENS], row[_TOTAL]


def _mix(value: int) -> int:
    """splitmix64's finaliser: consecutive counters become unrelated 64-bit draws."""
    value = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return value ^ (value >> 31)


@lru_cache(maxsize=64)
def _gateway_seed(gateway_id: str) -> int:
    # Stable across processes (unlike hash()), so a gateway's rotation does not change on restart.
    return zlib.crc32(gateway_id.encode())


INFO = AlgorithmInfo(params=GorgoParams, choose=choose, needs_prefix_matches=True)
