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
- herding (Dynamo #589): peer gateways' outstanding work is in the load view (``routing.state.sharing``),
  with a claim for each prefix update a peer sent since its last load report (a node a peer just
  sent a long prompt to does not look warm and idle to everyone for up to 200 ms);
  near-equal nodes count as ties and wider ties are split by two random choices per gateway, so
  gateways deciding on the same slightly stale view spread instead of all picking the same node.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Final

from mypy_extensions import i64

from routing.algorithms.base import AlgorithmInfo, Decision, NodeLoad, PrefixRent, RoutingRequest, RoutingView
from routing.contract import CostTerms, GorgoParams, NodeLiveState, NodeSpec

# Final: compiled, a constant is inlined where a plain module global is a dict lookup per use.
CAPACITY_FACTOR: Final = 1.0
# At a full batch (running == max_num_seqs) a prefill takes this much longer again. vLLM steps mix
# prefill chunks with one token per decoding sequence; the decode share of a step grows with the
# batch. 0.25 matches the emulated H100 engine (6.5 ms + 0.06 ms per decoding sequence per step).
DECODE_SLOWDOWN_AT_FULL_BATCH: Final = 0.25
HOT_LOAD_FACTOR: Final = 2.0
HOT_LOAD_SLACK_REQUESTS: Final = 4
TIE_BAND_REL: Final = 0.05
TIE_BAND_MS: Final = 2.0
# How long a request decodes on a node (~128 tokens at ~7 ms a step); with the node's queue and its
# prefill, how long it stays there: turns the requests outstanding there into their arrival rate
# (Little's law) for the displacement term.
RESIDENCE_MS: Final = 1000.0
# Homing (``_homing``) buys a prefix home only while the home node is idle: nothing queued there,
# and its queue term within this of what a busy batch's slowdown alone puts in it.
HOMING_IDLE_QUEUE_MS: Final = TIE_BAND_MS

_DEFAULT_PARAMS: Final = GorgoParams()


@dataclass(frozen=True, slots=True)
class Guards:
    """Which guards run; all of them in production. Tests switch one off to show what it prevents."""

    capacity: bool = True
    hot_prefix: bool = True
    spread_ties: bool = True


ALL_GUARDS: Final = Guards()


def choose(view: RoutingView, request: RoutingRequest) -> Decision:
    """Pick the node with the lowest estimated TTFT; the winner's and runner-up's terms come back."""
    return choose_guarded(view, request, ALL_GUARDS)


def choose_guarded(view: RoutingView, request: RoutingRequest, guards: Guards) -> Decision:
    """``choose`` with an explicit set of guards."""
    params = view.params if isinstance(view.params, GorgoParams) else _DEFAULT_PARAMS
    return choose_with(view, request, params, guards)


def choose_with(
    view: RoutingView,
    request: RoutingRequest,
    params: GorgoParams,
    guards: Guards = ALL_GUARDS,
    *,
    runner_up: bool = True,
) -> Decision:
    """``choose`` under ``params`` whatever ``view.params`` says: a shadow decides on the live view
    without a second ``RoutingView`` (issue 23), and without the runner-up it does not log."""
    totals, rows, full = _evaluate(view, request, guards, params, False)
    return _decide(
        totals, rows, full, params.w_displacement, guards, view, runner_up, params.homing_rent_ratio
    )


def choose_twice(view: RoutingView, request: RoutingRequest, other: GorgoParams) -> tuple[Decision, Decision]:
    """``choose`` under the view's parameters and under ``other`` (gorgo's parameters both).

    A shadow that moves gorgo's weights (issue 23) decides on the same per-node terms (queue,
    prefill, the displacement's factor, RTT), which do not depend on the weights: they are
    computed once and only the totals are weighed again, so the shadow costs a pick, not a
    decision. Another ``default_rtt_ms`` changes one term, the RTT of the nodes not measured yet:
    only those rows change.
    """
    params = view.params if isinstance(view.params, GorgoParams) else _DEFAULT_PARAMS
    totals, rows, full = _evaluate(view, request, ALL_GUARDS, params, True)
    other_rows = rows
    if other.default_rtt_ms != params.default_rtt_ms:
        measured = view.rtt_ms
        default_rtt_ms = other.default_rtt_ms
        other_rows = [row if row.node_id in measured else _with_rtt(row, default_rtt_ms) for row in rows]
    w_rtt, w_queue, w_displacement = other.w_rtt, other.w_queue, other.w_displacement
    reweighed = [
        w_rtt * row.rtt_ms + w_queue * row.queue_ms + row.prefill_ms + w_displacement * row.factor
        for row in other_rows
    ]
    return (
        _decide(totals, rows, full, params.w_displacement, ALL_GUARDS, view, True, params.homing_rent_ratio),
        _decide(reweighed, other_rows, full, w_displacement, ALL_GUARDS, view, True, other.homing_rent_ratio),
    )


def _with_rtt(row: _Row, rtt_ms: float) -> _Row:
    return _Row(
        row.requests,
        row.prefill_tokens,
        row.full,
        row.node,
        row.node_id,
        rtt_ms,
        row.queue_ms,
        row.prefill_ms,
        row.matched,
        row.uncached,
        row.factor,
    )


def choose_and_price(
    view: RoutingView, request: RoutingRequest, params: GorgoParams, node: NodeSpec, pricing: GorgoParams
) -> tuple[Decision, CostTerms | None]:
    """``choose_with(view, request, params, runner_up=False)`` and, from the same evaluation, the
    terms ``node`` has among these candidates under ``pricing`` (None: ``node`` is not one of them).

    Those are the terms ``choose`` under ``pricing`` gives ``node`` when it wins or runs up (the
    hot-prefix guard and the displacement net of staying included): a shadow prices the live
    policy's choice with them (issue 23), so a request both sides send to one node gets one
    prediction, and the candidates are evaluated once instead of once more for that node. When
    the decision is ``node`` and ``pricing`` is ``params`` (equal), both terms are one object.
    """
    weights = _weights(params)
    w_displacement = weights.w_displacement
    default_rtt_ms = weights.default_rtt_ms
    priced = _weights(pricing)
    w_rtt = priced.w_rtt
    w_queue = priced.w_queue
    pricing_w_displacement = priced.w_displacement
    pricing_default_rtt_ms = priced.default_rtt_ms
    totals, rows, full = _evaluate(view, request, ALL_GUARDS, params, pricing_w_displacement != 0.0)
    decision = _decide(totals, rows, full, w_displacement, ALL_GUARDS, view, False, weights.homing_rent_ratio)
    if (
        decision.node is node
        and priced.w_rtt == weights.w_rtt
        and priced.w_queue == weights.w_queue
        and pricing_w_displacement == w_displacement
        and pricing_default_rtt_ms == default_rtt_ms
    ):
        # The same node under the same parameters: the very same terms (one object, which the
        # request record then logs once: ``RequestRecord.shadow_terms``).
        return decision, decision.cost
    index = -1
    for position, candidate in enumerate(view.candidates):
        if candidate is node:
            index = position
            break
    if index < 0:
        return decision, None
    row = rows[index]
    if pricing_default_rtt_ms != default_rtt_ms and node.id not in view.rtt_ms:
        row = _with_rtt(row, pricing_default_rtt_ms)
    total_ms = (
        w_rtt * row.rtt_ms + w_queue * row.queue_ms + row.prefill_ms + pricing_w_displacement * row.factor
    )
    return decision, _terms(total_ms, row, pricing_w_displacement)


def price(view: RoutingView, request: RoutingRequest, node: NodeSpec, params: GorgoParams) -> CostTerms:
    """The terms of ``node`` alone under ``params``: what ``choose`` on a view with that one candidate
    returns, without building that view (a shadow prices the side whose algorithm prices nothing).
    As for a lone candidate, no hot-prefix guard: the node gets all the credit the index gives it."""
    totals, rows, _ = _evaluate(view, request, ALL_GUARDS, params, False, _lone(node))
    return _terms(totals[0], rows[0], params.w_displacement)


@dataclass(frozen=True, slots=True)
class _Fleet:
    """What the candidates contribute to every decision that does not change between requests."""

    candidates: tuple[NodeSpec, ...]
    # per candidate: node, id, region, region's slot, ms per prefill token, max_num_seqs (>= 1),
    # the outstanding requests at which it is full, its KV cache in tokens (read here once: a
    # NodeSpec's attribute is a generic lookup in the compiled loop)
    nodes: tuple[tuple[NodeSpec, int, str, int, float, int, float, int], ...]
    region_nodes: tuple[int, ...]  # candidates per region slot (the hot-prefix guard's means)
    regions: tuple[str, ...]  # per candidate, its region (staying at home against a forward)


def _constants(node: NodeSpec, slot: int) -> tuple[NodeSpec, int, str, int, float, int, float, int]:
    """One candidate's constants (``_Fleet.nodes``), its region in ``slot``."""
    rate = node.prefill_tokens_per_s
    max_seqs = max(node.max_num_seqs, 1)
    return (
        node,
        node.id,
        node.region,
        slot,
        1000.0 / rate if rate > 0 else 1000.0,
        max_seqs,
        max_seqs * CAPACITY_FACTOR,
        node.kv_capacity_tokens,
    )


def _fleet(candidates: tuple[NodeSpec, ...]) -> _Fleet:
    """The candidates' constants, cached per candidate tuple: the routing table keeps one tuple per
    model for the life of a snapshot, so the request path reads them instead of recomputing them
    per node per request. The entry holds the tuple, so its id cannot be reused while it lives."""
    entry = _FLEETS.get(id(candidates))
    if entry is not None and entry.candidates is candidates:
        return entry
    slots: dict[str, int] = {}
    region_nodes: list[int] = []
    nodes = []
    for node in candidates:
        slot = slots.setdefault(node.region, len(slots))
        if slot == len(region_nodes):
            region_nodes.append(0)
        region_nodes[slot] += 1
        nodes.append(_constants(node, slot))
    fleet = _Fleet(candidates, tuple(nodes), tuple(region_nodes), tuple(node.region for node in candidates))
    if len(_FLEETS) >= _FLEETS_KEPT:
        _FLEETS.clear()
    _FLEETS[id(candidates)] = fleet
    return fleet


class _Weights:
    """A ``GorgoParams``' numbers, read once per parameters object (a snapshot keeps one for its
    life): compiled, a msgspec struct's attribute is a generic lookup, this class's a load."""

    __slots__ = ("default_rtt_ms", "homing_rent_ratio", "params", "w_displacement", "w_queue", "w_rtt")

    def __init__(self, params: GorgoParams) -> None:
        self.params: Final = params  # held: its id cannot be reused while the entry lives
        self.homing_rent_ratio: Final = params.homing_rent_ratio
        self.w_rtt: Final = params.w_rtt
        self.w_queue: Final = params.w_queue
        self.w_displacement: Final = params.w_displacement
        self.default_rtt_ms: Final = params.default_rtt_ms


def _weights(params: GorgoParams) -> _Weights:
    """``params``' numbers, cached per parameters object like ``_fleet``."""
    weights = _WEIGHTS.get(id(params))
    if weights is not None and weights.params is params:
        return weights
    weights = _Weights(params)
    if len(_WEIGHTS) >= _WEIGHTS_KEPT:
        _WEIGHTS.clear()
    _WEIGHTS[id(params)] = weights
    return weights


def _lone(node: NodeSpec) -> _Fleet:
    """``node`` as the only candidate (pricing), cached per node object like ``_fleet``."""
    entry = _LONE.get(id(node))
    if entry is not None and entry.candidates[0] is node:
        return entry
    fleet = _Fleet((node,), (_constants(node, 0),), (1,), (node.region,))
    if len(_LONE) >= _LONE_KEPT:
        _LONE.clear()
    _LONE[id(node)] = fleet
    return fleet


def _evaluate(
    view: RoutingView,
    request: RoutingRequest,
    guards: Guards,
    params: GorgoParams,
    keep_factor: bool,
    fleet: _Fleet | None = None,
) -> tuple[list[float], list[_Row], list[int]]:
    """Every candidate's total under ``params``, its terms, and which candidates are full.

    ``keep_factor``: compute the displacement's factor even when ``w_displacement`` is 0
    (``choose_twice`` weighs it again). ``fleet``: other candidates than the view's.
    This is the hot loop (issue 23's budget): per node, only what changes between requests.
    """
    weights = _weights(params)
    w_rtt = weights.w_rtt
    w_queue = weights.w_queue
    w_displacement = weights.w_displacement
    default_rtt_ms = weights.default_rtt_ms
    with_factor = bool(w_displacement or keep_factor)
    home = view.region
    prompt_tokens = request.prompt_tokens_est
    if prompt_tokens < 0:
        prompt_tokens = 0
    if fleet is None:
        fleet = _fleet(view.candidates)
    # The view's maps are dicts on the gateway's path: typed as dicts here, compiled lookups are
    # direct (a Mapping's .get is a generic method call per node). Another Mapping is copied.
    load_map = view.load
    loads: dict[int, NodeLoad] = load_map if isinstance(load_map, dict) else dict(load_map)
    rtt_map = view.rtt_ms
    rtts: dict[int, float] = rtt_map if isinstance(rtt_map, dict) else dict(rtt_map)
    live_map = view.live
    lives: dict[int, NodeLiveState] = live_map if isinstance(live_map, dict) else dict(live_map)
    matched_map = view.matched_tokens
    matched_tokens: dict[int, int] = matched_map if isinstance(matched_map, dict) else dict(matched_map)
    with_live = bool(lives)
    measured_map = view.ms_per_token
    speeds: dict[int, float] | None = (
        None if not measured_map else measured_map if isinstance(measured_map, dict) else dict(measured_map)
    )
    capacity_guard = guards.capacity
    # Per region slot: outstanding requests, for the hot-prefix guard (a node against its
    # region's others). Only when some node has cache credit to lose.
    region_requests: list[int] | None = None
    if guards.hot_prefix and matched_tokens and len(fleet.nodes) > 1:
        region_requests = [0] * len(fleet.region_nodes)
        for _, node_id, _, slot, _, _, _, _ in fleet.nodes:
            load = loads.get(node_id)
            if load is not None:
                region_requests[slot] += load.outstanding_requests
        region_nodes = fleet.region_nodes
    full: list[int] = []
    totals: list[float] = []
    rows: list[_Row] = []
    # The displacement is priced net of staying (``_net_forwards``): none at home, and a forward
    # pays what it displaces beyond the least a home node displaces (``staying``; -1: no home node).
    staying = -1.0
    forward_factor = False  # some forward has a factor to net
    for node, node_id, region, slot, ms_per_token, max_seqs, capacity, kv_capacity in fleet.nodes:
        load = loads.get(node_id)
        if load is None:
            requests = prefill_tokens = own_requests = held_tokens = 0
        else:
            requests = load.outstanding_requests
            prefill_tokens = load.outstanding_prefill_tokens
            own_requests = load.home_requests
            held_tokens = load.outstanding_context_tokens
        running = float(requests)  # a float: scraped counts may replace it
        if with_live:
            live = lives.get(node_id)
            if live is not None and live.num_running is not None:
                scraped = live.num_running + (live.num_waiting or 0.0)
                if scraped > running:
                    running = scraped
        if speeds is not None:
            measured = speeds.get(node_id)
            if measured is not None:
                ms_per_token = measured  # what this gateway measured of the node, not what it was told
        is_full = capacity_guard and requests >= capacity
        if is_full:
            full.append(len(rows))

        matched = matched_tokens.get(node_id, 0)
        if matched:
            if matched > prompt_tokens:
                matched = prompt_tokens
            if region_requests is not None:
                others = region_nodes[slot] - 1
                if (
                    others
                    and requests
                    > HOT_LOAD_FACTOR * (region_requests[slot] - requests) / others + HOT_LOAD_SLACK_REQUESTS
                ):
                    matched = 0  # too hot to be credited for its cache: let the prefix spread
        uncached = prompt_tokens - matched

        slowdown = DECODE_SLOWDOWN_AT_FULL_BATCH * running / max_seqs
        queue_ms = (prefill_tokens * (1.0 + slowdown) + uncached * slowdown) * ms_per_token
        kv_excess = held_tokens + uncached - kv_capacity
        if kv_excess > 0 and held_tokens:
            # The prompt does not fit beside what the outstanding requests hold: vLLM admits it
            # only as they finish and free their blocks, each after about a residence, so the
            # held tokens drain at held / RESIDENCE_MS per ms.
            queue_ms += kv_excess * RESIDENCE_MS / held_tokens
        prefill_ms = uncached * ms_per_token
        rtt_ms = rtts.get(node_id, default_rtt_ms)
        displacement_factor = 0.0
        if with_factor and own_requests:
            # The node's own region's requests that arrive while this one holds the node (Little:
            # theirs there now over how long one stays there, its queue included), each waiting
            # for half its prefill or for all of it when it joins a queue. At home too: staying
            # is the alternative a forward is priced against (below).
            arrivals_per_ms = own_requests / (RESIDENCE_MS + queue_ms + prefill_ms)
            each_waits_ms = queue_ms + prefill_ms / 2
            if prefill_ms < each_waits_ms:  # min(), without the builtin's call
                each_waits_ms = prefill_ms
            displacement_factor = arrivals_per_ms * (queue_ms + prefill_ms) * each_waits_ms
        if with_factor:
            if region == home:
                if staying < 0.0 or displacement_factor < staying:
                    staying = displacement_factor
                displacement_factor = 0.0
            elif displacement_factor:
                forward_factor = True
        # .append in place (compiled: a direct list append; a bound method is a generic call)
        totals.append(w_rtt * rtt_ms + w_queue * queue_ms + prefill_ms + w_displacement * displacement_factor)
        rows.append(
            _Row(
                requests,
                prefill_tokens,
                is_full,
                node,
                node_id,
                rtt_ms,
                queue_ms,
                prefill_ms,
                matched,
                uncached,
                displacement_factor,
            )
        )
    if forward_factor and staying > 0.0:
        _net_forwards(totals, rows, fleet.regions, home, staying, w_displacement)
    return totals, rows, full


def _net_forwards(
    totals: list[float],
    rows: list[_Row],
    regions: tuple[str, ...],
    home: str,
    staying: float,
    w_displacement: float,
) -> None:
    """Each forward's displacement beyond what staying at home displaces (in place).

    Staying costs the home region's own later arrivals the least any home node's factor says
    (``staying``, > 0 here); a forward is charged only what it displaces above that (never a
    credit: a forward that displaces less than staying is left to the RTT, queue and prefill terms,
    as greedy routing would). A home node is charged nothing (``_evaluate`` leaves its factor 0),
    and with no home candidate (an outage) every option is a forward and pays its whole factor.
    """
    for index, row in enumerate(rows):
        raw = row.factor
        if not raw or regions[index] == home:
            continue
        factor = raw - staying
        if factor < 0.0:
            factor = 0.0
        totals[index] += w_displacement * (factor - raw)
        row.factor = factor


def _decide(
    totals: list[float],
    rows: list[_Row],
    full: list[int],
    w_displacement: float,
    guards: Guards,
    view: RoutingView,
    with_runner_up: bool,
    homing_rent_ratio: float,
) -> Decision:
    """The cheapest row (ties spread), past the capacity guard; with the runner-up's terms; a
    forward for a prefix cached only abroad pays rent or, once paid up, stays home (``_homing``)."""
    count = len(totals)
    # None: every candidate (the usual case, scanned at C speed); else those with room.
    room = (
        [index for index in range(count) if not rows[index].full]
        if full and guards.capacity and len(full) < count
        else None
    )
    winner = _pick(room, totals, rows, guards.spread_ties, view)
    rent_keys: tuple[int, ...] = ()
    rent_ms = 0.0
    prefix = view.prefix
    # The winner's region off its node first: a forward, the rare case, is all that needs the fleet.
    if (
        prefix is not None
        and homing_rent_ratio > 0.0
        and count > 1
        and rows[winner].node.region != view.region
    ):
        regions = _fleet(view.candidates).regions
        home, rent_keys, rent_ms = _homing(totals, rows, regions, winner, view, prefix, homing_rent_ratio)
        if home >= 0:
            # Paid up: this request stays home and caches the prefix there; the forward it would
            # have been is its runner-up.
            return Decision(
                node=rows[home].node,
                cost=_terms(totals[home], rows[home], w_displacement),
                runner_up=_terms(totals[winner], rows[winner], w_displacement) if with_runner_up else None,
                rent_keys=rent_keys,
                homed=True,
            )
    runner_up = -1
    if with_runner_up:
        if room is not None and len(room) > 1:
            for index in room:
                if index != winner and (runner_up < 0 or totals[index] < totals[runner_up]):
                    runner_up = index
        elif count > 1:
            # The first cheapest of the others: hide the winner, scan (a loop, not min() and
            # index(): compiled, the builtins' calls compare boxed floats, ~1 k instructions; the
            # loop picks the same index: the first whose total min() would have returned).
            winner_ms = totals[winner]
            totals[winner] = math.inf
            runner_up = 0
            lowest_ms = totals[0]
            for index in range(1, count):
                if totals[index] < lowest_ms:
                    lowest_ms = totals[index]
                    runner_up = index
            totals[winner] = winner_ms
            if runner_up == winner:  # every other total is infinite: the first of them
                runner_up = 1 if winner == 0 else 0
    return Decision(
        node=rows[winner].node,
        cost=_terms(totals[winner], rows[winner], w_displacement),
        runner_up=_terms(totals[runner_up], rows[runner_up], w_displacement) if runner_up >= 0 else None,
        rent_keys=rent_keys,
        rent_ms=rent_ms,
    )


def _homing(
    totals: list[float],
    rows: list[_Row],
    regions: tuple[str, ...],
    winner: int,
    view: RoutingView,
    prefix: PrefixRent,
    ratio: float,
) -> tuple[int, tuple[int, ...], float]:
    """A forward that only the cache decides (the prefix is held abroad, not at home): the rent it
    pays, or the home node it stays on instead once its prefix's rent is paid up.

    Returns (home index or -1, the prefix's rent keys or (), rent in ms). The rent goes to every key
    of the prefix the node abroad holds (``PrefixRent.keys``: its family's too), and the most any of
    them is owed decides. Rent is what this request would have
    saved at the best home node had that node held the prefix too; the price of bringing it home is
    this request's own extra wait there plus the wait its prefill adds for the home region's own
    arrivals (the displacement term's formula, at home). Buying when the rent reaches ``ratio``
    times the price is ski rental (``routing.state.homing``). It buys only while the home node is
    idle (no prefill queued there): a long prefill queued behind others makes every later arrival
    there wait too, and a busy home region is the overflow's case, not this one's.
    """
    home = -1
    home_total = math.inf
    here = view.region
    for index, row in enumerate(rows):
        if regions[index] == here and not row.full and totals[index] < home_total:
            home, home_total = index, totals[index]
    if home < 0:
        return -1, (), 0.0
    abroad = rows[winner]
    at_home = rows[home]
    extra_tokens = at_home.uncached - abroad.uncached
    if extra_tokens <= 0 or at_home.uncached <= 0:
        return -1, (), 0.0
    extra_ms = at_home.prefill_ms * extra_tokens / at_home.uncached
    rent_ms = totals[winner] - (home_total - extra_ms)  # what a home node holding it would save
    if rent_ms <= 0.0:
        return -1, (), 0.0  # home loses even with the prefix: the queue or RTT decides, not the cache
    keys = prefix.keys(abroad.matched)
    if not keys:
        return -1, (), 0.0
    # Idle: no prefill queued there, and no wait for KV room (the queue term holds no more than the
    # busy batch's slowdown of this very prefill).
    if (
        at_home.prefill_tokens == 0
        and at_home.queue_ms <= DECODE_SLOWDOWN_AT_FULL_BATCH * at_home.prefill_ms + HOMING_IDLE_QUEUE_MS
    ):
        price_ms = home_total - totals[winner]
        if price_ms < 0.0:
            price_ms = 0.0
        load = view.load.get(at_home.node_id)
        if load is not None and load.home_requests:
            # The home region's arrivals while the prefix is prefilled there wait half of it each.
            price_ms += load.home_requests / (RESIDENCE_MS + extra_ms) * extra_ms * extra_ms / 2
        owed_map = prefix.owed
        owed = 0.0
        for key in keys:
            paid = owed_map.get(key, 0.0)
            if paid > owed:
                owed = paid
        if owed >= ratio * price_ms:
            return home, keys, 0.0
    return -1, keys, rent_ms


class _Row:
    """One candidate's terms; its total is in a list beside it, so a shadow that only moves the
    weights weighs the same rows again.

    A class, not a tuple: compiled (routing/native.py) its fields are stored unboxed and read
    directly, where reading a tuple's row unboxes all ten fields (and building one boxes them):
    ~40 % of this module's instructions per decision went to that. ``factor`` is the
    displacement's, netted in place (``_net_forwards``).
    """

    __slots__ = (
        "factor",
        "full",
        "matched",
        "node",
        "node_id",
        "prefill_ms",
        "prefill_tokens",
        "queue_ms",
        "requests",
        "rtt_ms",
        "uncached",
    )

    def __init__(
        self,
        requests: int,
        prefill_tokens: int,
        full: bool,
        node: NodeSpec,
        node_id: int,
        rtt_ms: float,
        queue_ms: float,
        prefill_ms: float,
        matched: int,
        uncached: int,
        factor: float,
    ) -> None:
        self.requests: Final = requests
        self.prefill_tokens: Final = prefill_tokens
        self.full: Final = full
        self.node: Final = node
        self.node_id: Final = node_id
        self.rtt_ms: Final = rtt_ms
        self.queue_ms: Final = queue_ms
        self.prefill_ms: Final = prefill_ms
        self.matched: Final = matched
        self.uncached: Final = uncached
        self.factor = factor


# Final: compiled, a module-level name is a dict lookup per use unless it is Final.
_FLEETS: Final[dict[int, _Fleet]] = {}
_FLEETS_KEPT: Final = 64
_LONE: Final[dict[int, _Fleet]] = {}
_LONE_KEPT: Final = 1024
_WEIGHTS: Final[dict[int, _Weights]] = {}
_WEIGHTS_KEPT: Final = 64


def _terms(total_ms: float, row: _Row, w_displacement: float) -> CostTerms:
    # Positional, in CostTerms' field order (msgspec matches keyword names one by one: ~0.5 k
    # instructions a call, two calls a decision).
    return CostTerms(
        row.node_id,  # node_id
        total_ms,  # total_ms
        row.rtt_ms,  # rtt_ms
        row.queue_ms,  # queue_ms
        row.prefill_ms,  # prefill_ms
        row.matched,  # matched_tokens
        row.uncached,  # uncached_tokens
        w_displacement * row.factor,  # displacement_ms
    )


def _pick(
    room: list[int] | None, totals: list[float], rows: list[_Row], spread_ties: bool, view: RoutingView
) -> int:
    # A loop, not min(): the builtin's call costs more than three comparisons (compiled).
    best_ms = math.inf
    if room is None:
        for total_ms in totals:
            if total_ms < best_ms:
                best_ms = total_ms
    else:
        for index in room:
            if totals[index] < best_ms:
                best_ms = totals[index]
    limit_ms = best_ms + best_ms * TIE_BAND_REL + TIE_BAND_MS if spread_ties else best_ms
    if room is None:
        tied = [index for index, total_ms in enumerate(totals) if total_ms <= limit_ms]
    else:
        tied = [index for index in room if totals[index] <= limit_ms]
    count = len(tied)
    if count == 1:
        return tied[0]
    if count > 2 and spread_ties:
        # Power of two choices: the lighter of two tied nodes drawn by (gateway, request counter).
        # Always taking the lightest node herds every gateway that shares a stale view onto it;
        # two random choices keep the balance and make those gateways disagree.
        draw = _mix(_gateway_seed(view.gateway_id) + view.sequence)
        first = draw % count
        second = (first + 1 + (draw >> 16) % (count - 1)) % count
        tied = [tied[first], tied[second]]
    best = tied[0]
    for index in tied[1:]:  # the lightest: fewest requests, then prefill tokens, then total
        # Field by field, not as tuples: compiled, a tuple comparison builds and compares objects.
        row, best_row = rows[index], rows[best]
        if row.requests != best_row.requests:
            lighter = row.requests < best_row.requests
        elif row.prefill_tokens != best_row.prefill_tokens:
            lighter = row.prefill_tokens < best_row.prefill_tokens
        else:
            lighter = totals[index] < totals[best]
        if lighter:
            best = index
    return best


def _mix(value: i64) -> i64:
    """A 32-bit integer hash (two multiply-xorshift rounds): consecutive counters become unrelated
    draws. 32 bits, so every product stays below 2**59; ``i64``, so compiled it is machine
    arithmetic (mypyc's ``int`` multiplies operands of 2**30 or more as Python objects, ~2k
    instructions a draw); interpreted, ``i64`` is ``int`` and the draws are the same."""
    value &= 0xFFFFFFFF
    value = ((value ^ (value >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    value = ((value ^ (value >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    return value ^ (value >> 16)


_SEEDS: Final[dict[str, int]] = {}


def _gateway_seed(gateway_id: str) -> int:
    # Stable across processes (unlike hash()), so a gateway's rotation does not change on restart.
    seed = _SEEDS.get(gateway_id)
    if seed is None:
        if len(_SEEDS) >= 64:
            _SEEDS.clear()
        seed = _SEEDS[gateway_id] = zlib.crc32(gateway_id.encode())
    return seed


INFO = AlgorithmInfo(params=GorgoParams, choose=choose, needs_prefix_matches=True)
