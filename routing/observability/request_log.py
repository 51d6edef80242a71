"""The request log: one ``RequestRecord`` per finished request, appended to a capped Redis stream.

``submit`` is synchronous and O(1): it appends to an in-memory batch and returns. A background task
flushes the batch every ``flush_interval_s``. When Redis is slow or down the batch grows up to
``pending_max`` records; beyond that new records are dropped and counted, so logging never blocks,
slows or fails a request.

``submit_later`` takes the record's builder instead of the record: the gateway's request path
hands over what it knows and returns, and the records of one event-loop turn are built together
in a callback after it (a record of ~40 fields and the prompt's prefix hashes cost ~2-3 µs, paid
before the connection could serve its next request). The builders hold a request's prompt only
until that callback, one loop turn; a full batch refuses them unbuilt (dropped and counted).

A flush is one Lua call that runs ``XADD key MAXLEN ~ n * r <record>`` per record inside Redis:
one command to pack and one reply to parse per batch. A redis-py pipeline of XADDs packs and parses
every command in Python, which measured at ~15% of the gateway's throughput at 5k req/s and
doubled its p99 latency (benchmarks/gateway_overhead.py). The records travel as one argument,
one line each (``msgspec``'s ``encode_lines``: JSON as it writes it holds no line break, a string's
are escaped): redis-py packs each argument in Python (~1 µs each), which with one argument per
record cost more than the records' encoding.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from routing.background import Flag, run_bounded, sleep_unless, stop_tasks
from routing.contract import REQUEST_STREAM_FIELD, RedisKeys, RequestRecord

logger = logging.getLogger("routing.requestlog")

_MAX_BACKOFF_S = 5.0
_MAX_RECORDS_PER_CALL = 1000  # keeps each script run (which blocks Redis) to a millisecond or two

# KEYS[1]: the stream; ARGV: maxlen, field name, the encoded records, each ended by a newline (JSON
# as msgspec writes it has none inside: a string's line breaks are escaped).
_XADD_MANY_LUA = """
local records = ARGV[3]
local at = 1
local count = 0
while true do
  local stop = string.find(records, '\\n', at, true)
  if not stop then break end
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', ARGV[2], string.sub(records, at, stop - 1))
  at = stop + 1
  count = count + 1
end
return count
"""
_encoder = msgspec.json.Encoder()


def _encode_batch(batch: list[RequestRecord]) -> bytes:
    """The records' JSON, each ended by a newline, in one buffer (the script's ARGV[3]).

    One ``encode_lines`` call: encoded one by one into a shared buffer, each record cost a resize
    of it and its length a string (~3.5 k instructions a record)."""
    return _encoder.encode_lines(batch)


class RequestLog:
    """Batched, non-blocking writer of request records."""

    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        *,
        maxlen: int,
        pending_max: int,
        flush_interval_s: float,
    ) -> None:
        self._redis = redis
        self._stream = keys.request_stream
        self._maxlen = maxlen
        self._pending_max = pending_max
        self._flush_interval_s = flush_interval_s
        self._pending: list[RequestRecord] = []
        self._unbuilt: list[Callable[[], RequestRecord]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._xadd_many = redis.register_script(_XADD_MANY_LUA)
        self._task: asyncio.Task[None] | None = None
        self._closing = Flag()
        self.written = 0
        self.dropped = 0

    @property
    def pending(self) -> int:
        return len(self._pending) + len(self._unbuilt)

    def submit(self, record: RequestRecord) -> None:
        """Queue a record for the next flush, or drop (and count) it when the queue is full."""
        if len(self._pending) + len(self._unbuilt) >= self._pending_max:
            self.dropped += 1
            return
        self._pending.append(record)

    def submit_later(self, build: Callable[[], RequestRecord]) -> None:
        """Queue a record to be built after this event-loop turn (with the turn's others), or drop
        (and count) it when the queue is full. A builder that raises is logged and counted as dropped."""
        unbuilt = self._unbuilt
        if len(self._pending) + len(unbuilt) >= self._pending_max:
            self.dropped += 1
            return
        if not unbuilt:
            loop = self._loop
            if loop is None:
                # Looked up once: Python 3.11 makes a getpid() syscall per running-loop lookup.
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self._build_unbuilt)
        unbuilt.append(build)

    def _build_unbuilt(self) -> None:
        builders, self._unbuilt = self._unbuilt, []
        append = self._pending.append
        for build in builders:
            try:
                append(build())
            except Exception:
                self.dropped += 1
                logger.exception("request log: could not build a request record")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="gorgo-request-log")

    async def close(self, timeout_s: float = 2.0) -> None:
        """Stop the flusher and try one last flush, bounded in time."""
        self._closing.set()
        if self._task is not None:
            await stop_tasks([self._task], grace_s=timeout_s)
            self._task = None
        if not await run_bounded(self.flush(), timeout_s, "gorgo-request-log-final-flush"):
            self.dropped += len(self._pending) + len(self._unbuilt)
            self._pending = []
            self._unbuilt = []

    async def flush(self) -> None:
        """Write everything pending (one script call per 1,000 records); raises on Redis errors."""
        if self._unbuilt:
            self._build_unbuilt()
        while self._pending:
            batch = self._pending[:_MAX_RECORDS_PER_CALL]
            del self._pending[: len(batch)]
            try:
                await self._xadd_many(
                    keys=[self._stream], args=[self._maxlen, REQUEST_STREAM_FIELD, _encode_batch(batch)]
                )
            except BaseException:
                # Put the batch back in front (oldest first): a Redis blip loses nothing up to
                # pending_max; what does not fit is dropped and counted.
                self._pending[:0] = batch
                overflow = len(self._pending) - self._pending_max
                if overflow > 0:
                    self.dropped += overflow
                    del self._pending[self._pending_max :]
                raise
            self.written += len(batch)

    async def _run(self) -> None:
        backoff_s = self._flush_interval_s
        while not await sleep_unless(self._closing, backoff_s):
            try:
                await self.flush()
            except (RedisError, OSError) as exc:
                backoff_s = min(max(backoff_s * 2, 0.1), _MAX_BACKOFF_S)
                logger.warning("request log: Redis write failed (%s); retrying in %.1fs", exc, backoff_s)
            else:
                backoff_s = self._flush_interval_s
