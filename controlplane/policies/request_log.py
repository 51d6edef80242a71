"""Reading the gateways' request stream from the policies app (the online tuner, shadow and canary).

Telemetry's aggregation consumes the stream through a consumer group; the policies app only reads
it (XRANGE), beside that group, from a stream id of its own choosing: telemetry sits above
policies and cannot call into it. Reads are bounded: at most ``limit`` entries per call.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import redis

from routing.contract import REQUEST_STREAM_FIELD, RedisKeys, RequestRecord, decode

READ_BATCH = 2_000


def stream_id_at(unix_s: float) -> str:
    """The first stream id at or after ``unix_s`` (stream ids start with milliseconds)."""
    return f"{int(unix_s * 1000)}-0"


def read_records(
    client: redis.Redis,
    keys: RedisKeys,
    start: str,
    *,
    inclusive: bool,
    limit: int,
    keep: Callable[[RequestRecord], bool],
) -> tuple[list[RequestRecord], str]:
    """The records ``keep`` accepts, from stream id ``start`` on (``inclusive`` or strictly after);
    and the last id read (``start`` when nothing was). Unreadable entries are skipped."""
    kept: list[RequestRecord] = []
    last_id, read = start, 0
    while read < limit:
        batch = client.xrange(
            keys.request_stream, min=last_id if inclusive else f"({last_id}", max="+", count=READ_BATCH
        )
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
            if keep(record):
                kept.append(record)
        newest = batch[-1][0]
        last_id, inclusive = (newest.decode() if isinstance(newest, bytes) else newest), False
        if len(batch) < READ_BATCH:
            break
    return kept, last_id
