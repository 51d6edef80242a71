"""Per client key usage: the request stream's ``key_id``/``priority`` fields -> per-key time buckets.

Called by ``aggregation.apply_batch`` inside its transaction, with the batch's records that were
not counted before, so key usage is counted exactly once like the node and region buckets.
Records without a key (``GORGO_AUTH=off``, or a 401 for a secret that matched no key) are not
attributed to anyone; the node and region buckets still count them. Per-team figures are sums of
these buckets by ``team`` (the key's team, looked up once per batch).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime

from controlplane.histogram import add_to_histogram, histogram_quantile_ms, ttft_bin
from controlplane.keys.models import ClientKey
from routing.contract import RequestRecord
from telemetry.choices import RESOLUTION_SECONDS
from telemetry.models import KeyUsageAggregate
from telemetry.outcomes import client_refused, fleet_failed

log = logging.getLogger(__name__)

LIMITED_STATUSES = frozenset({429})
REFUSED_STATUSES = frozenset({401, 403})

# The sums a KeyUsageAggregate keeps: what a batch adds, and what readers that merge buckets add.
KEY_USAGE_SUMMED_FIELDS = (
    "count",
    "errors_4xx",
    "errors_5xx",
    "limited",
    "refused",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "usage_count",
    "ttft_count",
    "ttft_sum_ms",
)

KEY_ID_MAX_LENGTH = KeyUsageAggregate._meta.get_field("key_id").max_length
PRIORITY_MAX_LENGTH = KeyUsageAggregate._meta.get_field("priority").max_length

KeyBucket = tuple[str, str, str, datetime]  # resolution, key id, priority, bucket start


@dataclass(slots=True)
class KeyUsageDelta:
    """What a batch adds to one key's bucket."""

    count: int = 0
    errors_4xx: int = 0
    errors_5xx: int = 0
    limited: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_count: int = 0
    ttft_count: int = 0
    ttft_sum_ms: float = 0.0
    ttft_histogram: dict[str, int] = field(default_factory=dict)

    def add(self, record: RequestRecord) -> None:
        self.count += 1
        self.errors_5xx += int(fleet_failed(record))  # a stream that broke after its 200 too
        self.errors_4xx += int(client_refused(record))
        self.limited += int(record.status in LIMITED_STATUSES)
        self.refused += int(record.status in REFUSED_STATUSES)
        if record.prompt_tokens is not None:
            self.usage_count += 1
            self.prompt_tokens += record.prompt_tokens
            self.cached_tokens += record.cached_tokens or 0
            self.completion_tokens += record.completion_tokens or 0
        else:
            self.prompt_tokens += record.prompt_tokens_est
        if record.ttft_ms is not None:
            self.ttft_count += 1
            self.ttft_sum_ms += record.ttft_ms
            index = str(ttft_bin(record.ttft_ms))
            self.ttft_histogram[index] = self.ttft_histogram.get(index, 0) + 1


def key_usage_deltas(records: list[RequestRecord]) -> dict[KeyBucket, KeyUsageDelta]:
    """The batch's records that carry a key, added up per (resolution, key, priority, bucket)."""
    deltas: dict[KeyBucket, KeyUsageDelta] = {}
    for record in records:
        if not record.key_id:
            continue
        if len(record.key_id) > KEY_ID_MAX_LENGTH:
            # Not an id the control plane issued; storing it would fail the whole batch, every time.
            log.warning(
                "request %s: key id %.40r is not a client key id; not attributed",
                record.request_id,
                record.key_id,
            )
            continue
        priority = (record.priority or "")[:PRIORITY_MAX_LENGTH]
        for resolution, width_s in RESOLUTION_SECONDS.items():
            start = datetime.fromtimestamp(math.floor(record.ts / width_s) * width_s, tz=UTC)
            bucket = (str(resolution), record.key_id, priority, start)
            deltas.setdefault(bucket, KeyUsageDelta()).add(record)
    return deltas


def add_key_usage(records: list[RequestRecord]) -> int:
    """Add the records' key usage to the buckets (call inside the batch's transaction); returns
    how many buckets changed."""
    deltas = key_usage_deltas(records)
    if not deltas:
        return 0
    known = {
        key_id: (pk, team)
        for pk, key_id, team in ClientKey.objects.filter(
            key_id__in={key_id for _, key_id, _, _ in deltas}
        ).values_list("pk", "key_id", "team")
    }
    for bucket, delta in deltas.items():
        _apply(bucket, delta, known.get(bucket[1]))
    return len(deltas)


def _apply(bucket: KeyBucket, delta: KeyUsageDelta, key: tuple[int, str] | None) -> None:
    resolution, key_id, priority, start = bucket
    lookup = {"resolution": resolution, "key_id": key_id, "priority": priority, "bucket_start": start}
    row = KeyUsageAggregate.objects.select_for_update().filter(**lookup).first() or KeyUsageAggregate(
        **lookup
    )
    if key is not None:  # a deleted key keeps the team its buckets had
        row.client_key_id, row.team = key
    for name in KEY_USAGE_SUMMED_FIELDS:
        setattr(row, name, getattr(row, name) + getattr(delta, name))
    row.ttft_histogram = add_to_histogram(dict(row.ttft_histogram or {}), delta.ttft_histogram)
    row.ttft_p50_ms = histogram_quantile_ms(row.ttft_histogram, 0.5)
    row.ttft_p99_ms = histogram_quantile_ms(row.ttft_histogram, 0.99)
    row.save()
