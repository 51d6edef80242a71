"""The online tuner over the live system: windows from the request log, steps published as versions.

``tune_policy(policy, now_s)`` is one tick (the ``policies.tune`` task calls it periodically):

- the window is the time since the live version was published (plus ``SETTLE_S`` for the gateways
  to swap) and its requests are the request-log records routed *with that version*
  (``RequestRecord.policy_version``), answered with a first token; nothing is decided before the
  window is ``GORGO_TUNER_WINDOW_S`` long and holds ``GORGO_TUNER_MIN_REQUESTS`` of them;
- its p95 TTFT goes to ``policies.tuner_math.step`` (the (1+1)-ES), and the weights that returns are
  written into the policy's params and published through ``publishing.publish``, the
  one publish path, as a version authored by ``TUNER_AUTHOR`` whose note carries the evidence;
- every window is kept (``TuningWindow``): the dashboard's policy page draws weights and p95 from
  them, and the newest holds the search's state.

It stands aside when someone else moved the policy: if the live snapshot's weights are not the ones
the tuner left live (an operator published), the search restarts from the live weights; if the
policy has unpublished edits, the tuner publishes nothing (it would publish them too).
"""

from __future__ import annotations

import logging
import random
import statistics
from datetime import UTC, datetime

import msgspec
import redis
from django.conf import settings

from controlplane.connections import redis_client, redis_keys
from controlplane.policies import publishing, tuner_math
from controlplane.policies.models import RoutingPolicy, TuningWindow
from controlplane.policies.tuner_math import Bounds, TunerState, Weights
from routing.contract import REQUEST_STREAM_FIELD, GorgoParams, PolicySnapshot, RequestRecord, decode

log = logging.getLogger(__name__)

TUNER_AUTHOR = "online tuner"
SETTLE_S = 2.0  # gateways swap to a new snapshot within a second of its announcement
MAX_WINDOW_RECORDS = 50_000  # read at most this many request-log entries per tick
READ_BATCH = 2_000
BOUNDS = Bounds()


def live_weights(snapshot: PolicySnapshot) -> Weights | None:
    params = snapshot.policy.params
    return (params.w_rtt, params.w_queue) if isinstance(params, GorgoParams) else None


def window_ttfts(client: redis.Redis, version: int, since_s: float) -> list[float]:
    """TTFTs (ms) of the request-log records since ``since_s`` routed with policy ``version``."""
    key = redis_keys().request_stream
    start = f"{int(since_s * 1000)}-0"
    ttfts: list[float] = []
    read = 0
    while read < MAX_WINDOW_RECORDS:
        batch = client.xrange(key, min=start, max="+", count=READ_BATCH)
        if not batch:
            break
        read += len(batch)
        for _entry_id, fields in batch:
            raw = fields.get(REQUEST_STREAM_FIELD.encode())
            if raw is None:
                continue
            try:
                record = decode(raw, RequestRecord)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                continue
            if record.policy_version == version and record.status == 200 and record.ttft_ms is not None:
                ttfts.append(record.ttft_ms)
        last_id = batch[-1][0]
        start = "(" + (last_id.decode() if isinstance(last_id, bytes) else last_id)
        if len(batch) < READ_BATCH:
            break
    return ttfts


def tune_policy(policy: RoutingPolicy, now_s: float, rng: random.Random | None = None) -> TuningWindow | None:
    """One tick of the tuner on the active ``policy``; the window it closed, or None (not yet)."""
    live = publishing.live_version()
    if live is None or live.policy_id != policy.pk or live.published_at is None:
        return None
    weights = live_weights(live.compiled())
    if weights is None:
        return None
    last = policy.tuning_windows.first()
    state = TunerState.from_json(last.state) if last is not None and last.state else None
    if state is None or not _same(state.live, weights):
        state = TunerState(incumbent=weights)  # first tick, or an operator published: start here
    started_s = live.published_at.timestamp() + SETTLE_S
    if now_s - started_s < settings.GORGO_TUNER_WINDOW_S:
        return None
    ttfts = window_ttfts(redis_client(), live.number, started_s)
    if len(ttfts) < settings.GORGO_TUNER_MIN_REQUESTS:
        return None
    p95_ms = statistics.quantiles(ttfts, n=20)[18]  # the 95th percentile
    count = policy.tuning_windows.count()
    result = tuner_math.step(state, p95_ms, len(ttfts), rng or random.Random(f"{policy.pk}:{count}"), BOUNDS)
    version = None
    if result.publish is not None and not _same(result.publish, weights):
        if publishing.compile_policy(policy).checksum != live.checksum:
            log.info("tuner: %s has unpublished edits; not publishing over them", policy.name)
            return None
        policy.params = {
            **policy.params,
            "w_rtt": round(result.publish[0], 4),
            "w_queue": round(result.publish[1], 4),
        }
        policy.save(update_fields=["params", "last_updated"])
        version = publishing.publish(policy, note=result.note, system_author=TUNER_AUTHOR).version
    return TuningWindow.objects.create(
        policy=policy,
        started_at=datetime.fromtimestamp(started_s, UTC),
        ended_at=datetime.fromtimestamp(now_s, UTC),
        w_rtt=weights[0],
        w_queue=weights[1],
        p95_ms=p95_ms,
        requests=len(ttfts),
        outcome=result.outcome,
        sigma=result.state.sigma,
        note=result.note[:500],
        version=version,
        state=result.state.to_json(),
    )


def _same(a: Weights, b: Weights) -> bool:
    # The policy keeps weights to 4 decimals; the tuner's state keeps them exact.
    return abs(a[0] - b[0]) < 1e-3 and abs(a[1] - b[1]) < 1e-3
