"""What-if: the TTFT a policy edit would have given the last N minutes of traffic, before publishing.

``check_window`` (in the request, cheap) refuses what cannot be answered; ``run_what_if`` (the
``policies.what_if`` Celery task, up to ~a minute) does the work:

1. read the window's records from the request log (the capped Redis stream the gateways append
   to; its entry ids are arrival times in ms, so the window is an ``XRANGE``), at most
   ``MAX_REQUESTS`` (the newest, when there are more);
2. compile the policy as it is now (the draft) and the live version's policy settings, both with the
   current fleet, so the two differ only in the policy;
3. replay the same requests through each on the emulated fleet in virtual time
   (``simulator.replay``), with the RTT table telemetry measured;
4. summarise each as a TTFT distribution (p50/p90/p99, a CDF and a histogram on shared bins),
   beside the TTFT the window's requests really had (``measured``), and store the answer in Redis
   for an hour under the run's id.

Prompt text is never read: records carry lengths, regions, times and prefix hashes only.
"""

from __future__ import annotations

import math
import time
import uuid
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import msgspec
import redis

from controlplane.api import ConflictError
from controlplane.connections import redis_client, redis_keys
from controlplane.policies import publishing
from controlplane.policies.models import RoutingPolicy
from routing.contract import REQUEST_STREAM_FIELD, PolicySnapshot, RequestRecord, RTTTable, decode
from simulator.replay import (
    ReplayOutcome,
    ReplayRequest,
    percentile,
    replay,
    replayable,
    rtt_pairs,
    to_replay_requests,
)

MIN_MINUTES = 1
MAX_MINUTES = 60
DEFAULT_MINUTES = 15
# 10,000 requests replay within the promised minute on a 2-core machine (both policies);
# benchmarks/whatif_accuracy.py measures it.
MAX_REQUESTS = 10_000
READ_BATCH = 2_000
RESULT_TTL_S = 3600
# Each of the two replays gets half the task's budget (the task's soft limit is above both).
REPLAY_WALL_BUDGET_S = 45.0
CDF_POINTS = 50
HISTOGRAM_BINS = 30


class NoTraffic(ConflictError):
    """The window holds no replayable request."""

    code = "no_traffic"


class NothingLive(ConflictError):
    """No version is live: there is nothing to compare the draft with."""

    code = "nothing_live"


@dataclass(frozen=True, slots=True)
class Distribution:
    """One TTFT distribution (ms) of the window's requests."""

    count: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    cdf: tuple[tuple[float, float], ...]  # (ttft ms, share of requests at or below it)
    histogram: tuple[int, ...]  # counts on the result's shared ``histogram_edges_ms``
    cross_region_share: float | None = None
    unroutable: int = 0  # no eligible node under this policy
    unfinished: int = 0  # routed but no first token before the replay ended


@dataclass(frozen=True, slots=True)
class WhatIfResult:
    """A draft and the live policy on the same replayed window, and what the window really saw."""

    policy_id: int
    policy_name: str
    live_version: int
    live_policy: str
    minutes: int
    since: float  # unix seconds: first replayed arrival
    until: float
    requests: int  # replayed
    truncated: bool  # the window held more than MAX_REQUESTS; the newest were replayed
    with_prefix_hashes: float  # share of records that carried prefix hashes (0: every prompt unique)
    measured: Distribution
    live: Distribution
    draft: Distribution
    histogram_edges_ms: tuple[float, ...]
    replay_s: float  # wall time of both replays

    def to_json(self) -> dict[str, object]:
        return asdict(self)


# ---- the request log -------------------------------------------------------------------------


def read_records(
    client: redis.Redis, since_s: float, until_s: float | None = None, limit: int = MAX_REQUESTS
) -> tuple[list[RequestRecord], bool]:
    """Records that arrived in [since_s, until_s), oldest first, at most ``limit`` (the newest).

    Returns the records and whether more were there. Unreadable entries are skipped.
    """
    key = redis_keys().request_stream
    high = f"({int(until_s * 1000)}-0" if until_s is not None else "+"
    low = f"{int(since_s * 1000)}-0"
    records: list[RequestRecord] = []
    truncated = False
    field = REQUEST_STREAM_FIELD.encode()
    while True:
        batch = client.xrevrange(key, max=high, min=low, count=READ_BATCH)
        if not batch:
            break
        for _entry_id, fields in batch:
            raw = fields.get(field)
            if raw is None:
                continue
            try:
                records.append(decode(raw, RequestRecord))
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                continue
        if len(records) >= limit:
            truncated = len(records) > limit or len(batch) == READ_BATCH
            del records[limit:]
            break
        last_id = batch[-1][0]
        high = "(" + (last_id.decode() if isinstance(last_id, bytes) else last_id)
        if len(batch) < READ_BATCH:
            break
    records.reverse()
    return records, truncated


def read_rtt_table(client: redis.Redis) -> RTTTable | None:
    raw = client.get(redis_keys().live_rtt)
    if raw is None:
        return None
    try:
        return decode(raw, RTTTable)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None


# ---- checks (in the request) and the run (in the task) ----------------------------------------


def window_start(minutes: int, now_s: float) -> float:
    return now_s - minutes * 60.0


def check_window(policy: RoutingPolicy, minutes: int, now_s: float) -> None:
    """Raise what the API answers before queueing a run: invalid draft (400), nothing live or no
    traffic (409). Cheap: one compile and one stream read of a single entry."""
    publishing.compile_policy(policy)  # ValidationError: the draft is invalid
    if publishing.live_version() is None:
        raise NothingLive(
            "No policy version is live yet, so there is nothing to compare with; publish one first."
        )
    key = redis_keys().request_stream
    newest = redis_client().xrevrange(
        key, max="+", min=f"{int(window_start(minutes, now_s) * 1000)}-0", count=1
    )
    if not newest:
        raise NoTraffic(
            f"The request log holds no request from the last {minutes} minute(s): nothing to replay. "
            "Choose a longer window, or send traffic through the gateways first."
        )


def run_what_if(
    policy: RoutingPolicy, minutes: int, now_s: float, clock: Callable[[], float] = time.perf_counter
) -> WhatIfResult:
    """Replay the window with the draft and the live policy (see the module docstring)."""
    draft_snapshot = publishing.compile_policy(policy)
    live = publishing.live_version()
    if live is None:
        raise NothingLive(
            "No policy version is live yet, so there is nothing to compare with; publish one first."
        )
    live_snapshot = publishing.compile_spec(live.compiled().policy)
    client = redis_client()
    records, truncated = read_records(client, window_start(minutes, now_s), now_s)
    requests = to_replay_requests(records)
    if not requests:
        raise NoTraffic(
            f"The last {minutes} minute(s) hold no request that reached a node: nothing to replay."
        )
    rtt = rtt_pairs(read_rtt_table(client))
    started = clock()
    live_outcome = _replay(live_snapshot, rtt, requests, clock)
    draft_outcome = _replay(draft_snapshot, rtt, requests, clock)
    replay_s = clock() - started
    chosen = [r for r in records if replayable(r)]
    measured = sorted(r.ttft_ms for r in chosen if r.ttft_ms is not None)
    live_ttfts = sorted(live_outcome.ttfts_ms())
    draft_ttfts = sorted(draft_outcome.ttfts_ms())
    edges = histogram_edges([*measured, *live_ttfts, *draft_ttfts])
    first_ts = min(r.ts for r in chosen)
    return WhatIfResult(
        policy_id=policy.pk,
        policy_name=policy.name,
        live_version=live.number,
        live_policy=live.policy.name,
        minutes=minutes,
        since=first_ts,
        until=now_s,
        requests=len(requests),
        truncated=truncated,
        with_prefix_hashes=sum(1 for r in requests if r.prefix_hashes) / len(requests),
        measured=distribution(measured, edges, cross_region_share=_share(chosen)),
        live=distribution(live_ttfts, edges, outcome=live_outcome),
        draft=distribution(draft_ttfts, edges, outcome=draft_outcome),
        histogram_edges_ms=edges,
        replay_s=replay_s,
    )


def _replay(
    snapshot: PolicySnapshot,
    rtt: dict[tuple[str, int], float],
    requests: list[ReplayRequest],
    clock: Callable[[], float],
) -> ReplayOutcome:
    return replay(snapshot, rtt, requests, wall_budget_s=REPLAY_WALL_BUDGET_S, clock=clock)


def _share(records: Sequence[RequestRecord]) -> float | None:
    known = [r for r in records if r.node_region is not None]
    if not known:
        return None
    return sum(1 for r in known if r.node_region != r.gateway_region) / len(known)


# ---- summaries --------------------------------------------------------------------------------


def histogram_edges(values: Sequence[float], bins: int = HISTOGRAM_BINS) -> tuple[float, ...]:
    """Log-spaced bin edges covering every value (TTFTs span ms to seconds); shared by all series."""
    positive = [v for v in values if v > 0]
    if not positive:
        return (0.0, 1.0)
    low, high = max(0.1, min(positive)), max(positive)
    if high <= low:
        high = low * 1.1
    step = (math.log(high) - math.log(low)) / bins
    return tuple(round(math.exp(math.log(low) + step * i), 3) for i in range(bins + 1))


def distribution(
    sorted_ms: Sequence[float],
    edges: Sequence[float],
    *,
    outcome: ReplayOutcome | None = None,
    cross_region_share: float | None = None,
) -> Distribution:
    """Percentiles, a CDF of ``CDF_POINTS`` quantiles, and counts on ``edges`` (ends included)."""
    counts = [0] * (len(edges) - 1)
    for value in sorted_ms:
        index = _bin(edges, value)
        counts[index] += 1
    cdf = tuple(
        (round(value, 3), round(q / 100.0, 4))
        for q in _cdf_quantiles()
        if (value := percentile(sorted_ms, q)) is not None
    )
    if outcome is not None:
        routed = [r for r in outcome.requests if r.node_id is not None]
        cross_region_share = sum(1 for r in routed if r.cross_region) / len(routed) if routed else None
    return Distribution(
        count=len(sorted_ms),
        p50_ms=_round(percentile(sorted_ms, 50)),
        p90_ms=_round(percentile(sorted_ms, 90)),
        p99_ms=_round(percentile(sorted_ms, 99)),
        mean_ms=_round(sum(sorted_ms) / len(sorted_ms)) if sorted_ms else None,
        cdf=cdf,
        histogram=tuple(counts),
        cross_region_share=_round(cross_region_share, 4),
        unroutable=outcome.unroutable if outcome is not None else 0,
        unfinished=outcome.unfinished if outcome is not None else 0,
    )


def _bin(edges: Sequence[float], value: float) -> int:
    return min(max(bisect_right(edges, value) - 1, 0), len(edges) - 2)


def _cdf_quantiles() -> list[float]:
    return [100.0 * i / CDF_POINTS for i in range(1, CDF_POINTS)] + [99.0, 100.0]


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


# ---- runs: stored in Redis for an hour ---------------------------------------------------------


def run_key(run_id: str) -> str:
    return f"{redis_keys().prefix}:whatif:{run_id}"


def new_run(policy_id: int, minutes: int) -> str:
    """Record a queued run and return its id."""
    run_id = uuid.uuid4().hex
    save_run(run_id, {"id": run_id, "policy": policy_id, "minutes": minutes, "status": "pending"})
    return run_id


def save_run(run_id: str, state: dict[str, object]) -> None:
    redis_client().set(run_key(run_id), msgspec.json.encode(state), ex=RESULT_TTL_S)


def load_run(run_id: str) -> dict[str, object] | None:
    raw = redis_client().get(run_key(run_id))
    return None if raw is None else msgspec.json.decode(raw)
