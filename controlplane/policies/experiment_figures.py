"""Shadow and canary figures (issue 23): the request log -> per-region sums on each running experiment.

``collect(client, keys, experiment)`` reads the request stream from where the experiment's figures
left off (``figures["cursor"]``, a stream id; at the start, the experiment's start time), at most
``MAX_RECORDS_PER_TICK`` entries, adds the records that name the experiment, and saves the sums and
the new cursor in one transaction that first checks the cursor is still the one it read
(compare-and-swap), so every record counts once even if two workers ran it at once. It reads with
XRANGE (``policies.request_log``), like the online tuner. The sums, per gateway region:

- ``shadow``: ``requests`` the shadow decided too, ``moved`` (it would have chosen another node),
  ``cross_live`` / ``cross_shadow`` (the live / the shadow node is in another region), and the
  predicted TTFT (``rtt + queue + prefill`` of the chosen node, from the records' cost terms) of
  both as log-bucketed histograms, with their p50/p99 and the shares worked out;
- ``live`` and ``canary`` (the arms): ``requests`` (client errors, 4xx, left out: they say nothing
  of the policy), ``errors`` (5xx, no answer, or an answer without a first token), and the measured
  TTFT's count, sum and sum of squares (``canary_stats.ArmSums``) plus its histogram and p50/p99.

The stream is capped (the gateways' ``MAXLEN``): a worker that falls further behind than the cap
misses the records trimmed meanwhile; the figures are sums of what it read.
"""

from __future__ import annotations

from typing import Any

import redis
from django.db import transaction
from django.utils import timezone

from controlplane.histogram import add_to_histogram, histogram_quantile_ms, ttft_bin
from controlplane.policies.models import PolicyExperiment
from controlplane.policies.request_log import read_records, stream_id_at
from controlplane.policies.tuner_math import LogSums
from routing.contract import CostTerms, RedisKeys, RequestRecord

MAX_RECORDS_PER_TICK = 50_000


def predicted_ttft_ms(cost: CostTerms | None, node_id: int | None) -> float | None:
    """The cost model's TTFT for the node a decision chose (unweighted: what the client would wait)."""
    if cost is None or node_id is None or cost.node_id != node_id:
        return None
    return cost.rtt_ms + cost.queue_ms + cost.prefill_ms


def failed(record: RequestRecord) -> bool:
    """A server-side failure: 5xx, no answer at all, an answer that never sent a first token, or a
    client that gave up waiting for one (499 before a first token: the arm made it wait too long)."""
    return (
        record.status >= 500
        or record.status == 0
        or (record.status < 400 and record.ttft_ms is None)
        or _gave_up_waiting(record)
    )


def _gave_up_waiting(record: RequestRecord) -> bool:
    return record.status == 499 and record.ttft_ms is None


def collect(client: redis.Redis, keys: RedisKeys, experiment: PolicyExperiment) -> int:
    """Add the request-log records since the experiment's cursor to its figures; how many were its own."""
    figures = dict(experiment.figures or {})
    cursor = figures.get("cursor") or stream_id_at(experiment.started_at.timestamp())
    # From the start time itself at first; afterwards, strictly after the cursor.
    mine, last_id = read_records(
        client,
        keys,
        cursor,
        inclusive="cursor" not in figures,
        limit=MAX_RECORDS_PER_TICK,
        keep=lambda record: experiment.pk in (record.shadow_id, record.canary_id),
    )
    if last_id == cursor:
        return 0
    with transaction.atomic():
        # Compare-and-swap on the cursor: a run that raced this one has counted these records.
        locked = PolicyExperiment.objects.select_for_update().get(pk=experiment.pk)
        if (locked.figures or {}).get("cursor") != figures.get("cursor"):
            return 0
        add_records(figures, experiment.pk, mine)
        figures["cursor"] = last_id
        locked.figures = figures
        locked.figures_updated_at = timezone.now()
        locked.save(update_fields=["figures", "figures_updated_at"])
    experiment.figures, experiment.figures_updated_at = locked.figures, locked.figures_updated_at
    return len(mine)


def add_records(figures: dict[str, Any], experiment_id: int, records: list[RequestRecord]) -> None:
    """Add an experiment's records to its figures (in place) and work the summaries out again."""
    regions: dict[str, Any] = figures.setdefault("regions", {})
    for record in records:
        region = regions.setdefault(record.gateway_region, {})
        if record.shadow_id == experiment_id:
            _add_shadow(region.setdefault("shadow", {}), record)
        if record.canary_id == experiment_id and record.arm in ("live", "canary"):
            _add_arm(region.setdefault(record.arm, {}), record)
    for region in regions.values():
        _summarise(region)


def _count(sums: dict[str, Any], name: str, amount: float = 1) -> None:
    sums[name] = sums.get(name, 0) + amount


def _add_shadow(sums: dict[str, Any], record: RequestRecord) -> None:
    if record.shadow_node_id is None or record.node_id is None:
        return  # no decision on one side (no eligible node, refused before routing)
    _count(sums, "requests")
    _count(sums, "moved", record.shadow_node_id != record.node_id)
    _count(sums, "cross_live", record.node_region != record.gateway_region)
    _count(sums, "cross_shadow", record.shadow_node_region != record.gateway_region)
    for side, cost, node_id in (
        ("live", record.cost, record.node_id),
        ("shadow", record.shadow_terms, record.shadow_node_id),
    ):
        predicted = predicted_ttft_ms(cost, node_id)
        if predicted is not None:
            histogram = sums.setdefault(f"{side}_predicted_histogram", {})
            add_to_histogram(histogram, {str(ttft_bin(predicted)): 1})


def _add_arm(sums: dict[str, Any], record: RequestRecord) -> None:
    # Client errors say nothing about the policy, except a client that left before its first token
    # came: counted as an error of its arm, or an arm that made clients wait until they hung up
    # would look healthy (its slowest requests gone from its TTFT too).
    if 400 <= record.status < 500 and not _gave_up_waiting(record):
        return
    _count(sums, "requests")
    _count(sums, "errors", failed(record))
    if record.ttft_ms is not None and record.status < 400:
        _count(sums, "ttft_count")
        _count(sums, "ttft_sum_ms", record.ttft_ms)
        _count(sums, "ttft_sumsq_ms2", record.ttft_ms * record.ttft_ms)
        # The online tuner's statistic (``tuner_math.LogSums``): mean log TTFT and its variance.
        log_ttft = LogSums.log_of(record.ttft_ms)
        _count(sums, "log_ttft_count")
        _count(sums, "log_ttft_sum", log_ttft)
        _count(sums, "log_ttft_sumsq", log_ttft * log_ttft)
        add_to_histogram(sums.setdefault("ttft_histogram", {}), {str(ttft_bin(record.ttft_ms)): 1})


def arm_totals(figures: dict[str, Any], arm: str) -> tuple[LogSums, dict[str, int]]:
    """One arm's TTFT over every region: its log sums and its merged histogram (the tuner's input)."""
    count, total, total_sq = 0, 0.0, 0.0
    histogram: dict[str, int] = {}
    for sides in (figures or {}).get("regions", {}).values():
        sums = sides.get(arm) if isinstance(sides, dict) else None
        if not sums:
            continue
        count += sums.get("log_ttft_count", 0)
        total += sums.get("log_ttft_sum", 0.0)
        total_sq += sums.get("log_ttft_sumsq", 0.0)
        add_to_histogram(histogram, sums.get("ttft_histogram", {}))
    return LogSums(count, total, total_sq), histogram


def _summarise(region: dict[str, Any]) -> None:
    """The figures a reader wants, worked out from the sums (kept beside them)."""
    shadow = region.get("shadow")
    if shadow and shadow.get("requests"):
        n = shadow["requests"]
        shadow["moved_share"] = shadow.get("moved", 0) / n
        shadow["cross_region_share_live"] = shadow.get("cross_live", 0) / n
        shadow["cross_region_share_shadow"] = shadow.get("cross_shadow", 0) / n
        for side in ("live", "shadow"):
            histogram = shadow.get(f"{side}_predicted_histogram", {})
            shadow[f"{side}_predicted_p50_ms"] = histogram_quantile_ms(histogram, 0.5)
            shadow[f"{side}_predicted_p99_ms"] = histogram_quantile_ms(histogram, 0.99)
    for arm in ("live", "canary"):
        sums = region.get(arm)
        if sums:
            histogram = sums.get("ttft_histogram", {})
            sums["ttft_p50_ms"] = histogram_quantile_ms(histogram, 0.5)
            sums["ttft_p99_ms"] = histogram_quantile_ms(histogram, 0.99)
            sums["error_rate"] = sums.get("errors", 0) / sums["requests"] if sums.get("requests") else None


def figures_without_histograms(figures: dict[str, Any]) -> dict[str, Any]:
    """Per region and side, the figures without their histograms (what a page shows)."""
    return {
        region: {
            side: {name: value for name, value in sums.items() if not name.endswith("histogram")}
            for side, sums in sides.items()
            if isinstance(sums, dict)
        }
        for region, sides in (figures or {}).get("regions", {}).items()
        if isinstance(sides, dict)
    }
