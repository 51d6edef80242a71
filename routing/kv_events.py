"""The gateway's subscriber to vLLM's KV-cache events (``--kv-events-config``), one per node.

Wire format (vLLM ``vllm/distributed/kv_events.py``): ZMQ PUB, three frames per message (topic,
sequence number as 8 bytes big-endian, msgpack ``EventBatch``). The batch and its events come in
two encodings, both decoded here: positional arrays with the event's tag first (vLLM before
2026-06) and maps with the tag under ``"type"``. Fields keep being added to both: positions past
the ones read and unknown map keys are ignored, and unknown event types are counted as dropped.
Block hashes are integers or byte strings.

Each ``NodeSubscriber`` (an asyncio task on the gateway's loop) keeps its node's blocks in the
shared ``PreciseIndex`` and decides the node's **mode**:

- ``precise`` while its SUB socket is connected, its sequence is in order and its events are
  fresh (lag under ``MAX_LAG_S``). With a replay endpoint, from when the replay of what the node
  already holds is done; without one, from the connection (blocks stored before it stay unknown:
  an under-estimate);
- ``approximate`` otherwise: before the first connection, while disconnected (the node may be
  restarting), for ``RESYNC_S`` after a sequence gap that replay could not fill (the index then
  restarts empty), and while events lag.

Sequence rules: every (re)connection empties the node and replays from 0 (a reconnect may be a
restarted vLLM: new hashes, new sequence), a sequence number lower than expected means the
publisher restarted (empty, replay from 0), a higher one is a gap (replay from the expected one;
if the publisher's buffer no longer has it, empty and count it). ``AllBlocksCleared`` empties it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from routing.contract import SCHEMA_VERSION, GatewayKVState, NodeKVState, RedisKeys, encode
from routing.precise_index import PreciseIndex

logger = logging.getLogger("routing.kv_events")

Mode = Literal["precise", "approximate"]
MAX_LAG_S = 5.0  # events older than this on arrival: the node is treated as approximate
RESYNC_S = 30.0  # after an unrecoverable gap, approximate for this long while the index refills
REPLAY_TIMEOUT_S = 2.0
STATE_INTERVAL_S = 2.0  # how often a gateway reports its nodes' modes for the dashboard
END_SEQ = -1


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[Any]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None
    unknown: int  # events of a type this gateway does not know (ignored)


class BatchError(ValueError):
    """The payload is not an EventBatch in either encoding."""


_decoder = msgspec.msgpack.Decoder()


def _hash_key(value: Any) -> Any:
    if isinstance(value, list):  # some encoders give bytes as a list of ints
        return bytes(value)
    return value


def _engine_key(value: Any, medium: str | None) -> Any:
    key = _hash_key(value)
    # The same block may be held on GPU and offloaded to CPU: separate entries, same content.
    return key if medium in (None, "GPU") else (medium, key)


def decode_batch(payload: bytes) -> Batch:
    """Decode an ``EventBatch`` payload (legacy arrays or maps); raise ``BatchError`` if neither."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise BatchError(f"not msgpack: {exc}") from None
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "events" in raw:
        ts, events, rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise BatchError("not an EventBatch (array or map)")
    if not isinstance(events, list) or not isinstance(ts, int | float):
        raise BatchError("EventBatch has no event list or timestamp")
    decoded: list[Stored | Removed | Cleared] = []
    unknown = 0
    for event in events:
        try:
            item = _decode_event(event)
        except (IndexError, KeyError, TypeError, ValueError):
            raise BatchError("malformed event") from None
        if item is None:
            unknown += 1
        else:
            decoded.append(item)
    return Batch(float(ts), decoded, rank if isinstance(rank, int) else None, unknown)


def _decode_event(event: Any) -> Stored | Removed | Cleared | None:
    if isinstance(event, list):
        tag = event[0]
        if tag == "BlockStored":
            medium = event[6] if len(event) > 6 else None
            return Stored(
                [_engine_key(h, medium) for h in event[1]],
                None if event[2] is None else _engine_key(event[2], medium),
                event[3],
                int(event[4]),
                medium,
            )
        if tag == "BlockRemoved":
            medium = event[2] if len(event) > 2 else None
            return Removed([_engine_key(h, medium) for h in event[1]], medium)
        if tag == "AllBlocksCleared":
            return Cleared()
        return None
    if isinstance(event, dict):
        tag = event.get("type")
        medium = event.get("medium")
        if tag == "BlockStored":
            parent = event.get("parent_block_hash")
            return Stored(
                [_engine_key(h, medium) for h in event["block_hashes"]],
                None if parent is None else _engine_key(parent, medium),
                event["token_ids"],
                int(event["block_size"]),
                medium,
            )
        if tag == "BlockRemoved":
            return Removed([_engine_key(h, medium) for h in event["block_hashes"]], medium)
        if tag == "AllBlocksCleared":
            return Cleared()
        return None
    raise TypeError("event is neither an array nor a map")


# ---------------------------------------------------------------------------------------------
# Per-node statistics (metrics and the dashboard read them)
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class NodeEventStats:
    received: int = 0  # events received (in decodable batches)
    applied: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    gaps: int = 0
    replays: int = 0
    resets: int = 0
    last_lag_s: float | None = None
    last_event_at: float | None = None  # unix s of the last batch received
    connected: bool = False


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one node publishes (from the snapshot's ``NodeSpec.kv_events_endpoint``)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


# ---------------------------------------------------------------------------------------------
# One node's subscriber
# ---------------------------------------------------------------------------------------------


class NodeSubscriber:
    """Keeps one node's blocks in the shared index from its event stream."""

    def __init__(
        self,
        node_id: int,
        source: EventSource,
        index: PreciseIndex,
        context: zmq.asyncio.Context,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node_id = node_id
        self.source = source
        self.stats = NodeEventStats()
        self._index = index
        self._ctx = context
        self._clock = clock
        self._expected: int | None = None
        self._resync_until = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # ---- mode ---------------------------------------------------------------------------------

    def mode(self, now_s: float) -> Mode:
        stats = self.stats
        if not stats.connected or now_s < self._resync_until:
            return "approximate"
        if self._expected is None and self.source.replay_endpoint:
            return "approximate"  # the replay of what it already holds is not done yet
        if stats.last_lag_s is not None and stats.last_lag_s > MAX_LAG_S:
            return "approximate"
        return "precise"

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"gorgo-kv-events-{self.node_id}"
        )

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._index.forget_node(self.node_id)

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await self._on_monitor(await monitor.recv_multipart())
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        self.stats.dropped["malformed"] += 1
                        continue
                    await self._on_message(int.from_bytes(frames[1], "big", signed=True), frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:  # pragma: no cover - a bug; the node falls back to the approximate index
            logger.exception("KV-event subscriber of node %s failed", self.node_id)
            self.stats.connected = False
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_monitor(self, frames: list[bytes]) -> None:
        event = int.from_bytes(frames[0][:2], "little")
        if event == zmq.EVENT_CONNECTED:
            # A (re)connection may be a restarted node: start over from what it can replay.
            self._reset(count=False)
            self.stats.connected = True
            if self.source.replay_endpoint:
                await self._replay(0)
        elif event == zmq.EVENT_DISCONNECTED:
            self.stats.connected = False

    def _reset(self, *, count: bool) -> None:
        self._index.clear(self.node_id)
        self._expected = None
        if count:
            self.stats.resets += 1

    async def _on_message(self, seq: int, payload: bytes) -> None:
        expected = self._expected
        if expected is None:
            self._expected = seq  # the first message (no replay, or it failed): start here
        elif seq < expected:
            return  # already applied through replay
        elif seq > expected:
            self.stats.gaps += 1
            if not (self.source.replay_endpoint and await self._replay(expected, until=seq)):
                # The publisher no longer has what was missed: start again, approximate a while.
                self.stats.dropped["gap"] += seq - expected
                self._reset(count=True)
                self._resync_until = self._clock() + RESYNC_S
            self._expected = seq
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        stats = self.stats
        try:
            batch = decode_batch(payload)
        except BatchError:
            stats.dropped["malformed"] += 1
            self._expected = seq + 1
            return
        now = self._clock()
        stats.received += len(batch.events) + batch.unknown
        stats.last_event_at = now
        stats.last_lag_s = max(0.0, now - batch.ts)
        if batch.unknown:
            stats.dropped["unknown_event"] += batch.unknown
        index = self._index
        node_id = self.node_id
        for event in batch.events:
            if isinstance(event, Stored):
                unkeyed = index.store(
                    node_id, event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
                )
                if unkeyed:
                    stats.dropped["unknown_parent"] += 1
                    continue
            elif isinstance(event, Removed):
                index.remove(node_id, event.block_hashes)
            else:
                index.clear(node_id)
            stats.applied += 1
        self._expected = seq + 1

    async def _replay(self, start: int, until: int | None = None) -> bool:
        """Apply the publisher's buffered batches from ``start`` (below ``until``).

        False when the replay timed out, or when ``start`` > 0 and the buffer no longer reaches
        back to it. From 0, whatever the buffer holds is the best there is: True.
        """
        self.stats.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.source.replay_endpoint or "")
        loop = asyncio.get_running_loop()
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = loop.time() + REPLAY_TIMEOUT_S
            first = True
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await dealer.poll(remaining * 1000):
                    logger.warning("KV-event replay from node %s timed out", self.node_id)
                    return False
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    if self._expected is None and start == 0:
                        self._expected = 0  # nothing was ever published: known empty
                    return True
                if first:
                    first = False
                    if start > 0 and seq > start:
                        return False  # the buffer begins after what was missed
                if until is not None and seq >= until:
                    continue  # the live stream delivers these
                if self._expected is None or seq >= self._expected:
                    self._apply(seq, frames[2])
        finally:
            dealer.close(linger=0)


# ---------------------------------------------------------------------------------------------
# All subscribers of one gateway
# ---------------------------------------------------------------------------------------------


class KVEvents:
    """The gateway's subscribers, one per node with an events endpoint in the snapshot."""

    def __init__(self, index: PreciseIndex | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.index = index if index is not None else PreciseIndex()
        self._clock = clock
        self._ctx: zmq.asyncio.Context | None = None
        self.subscribers: dict[int, NodeSubscriber] = {}

    def mode(self, node_id: int, now_s: float | None = None) -> Mode:
        subscriber = self.subscribers.get(node_id)
        if subscriber is None:
            return "approximate"
        return subscriber.mode(self._clock() if now_s is None else now_s)

    async def sync(self, sources: dict[int, EventSource]) -> None:
        """Start subscribers for new sources, stop those gone or changed."""
        if self._ctx is None and sources:
            self._ctx = zmq.asyncio.Context()
        for node_id, subscriber in list(self.subscribers.items()):
            if sources.get(node_id) != subscriber.source:
                del self.subscribers[node_id]
                await subscriber.stop()
        for node_id, source in sources.items():
            if node_id not in self.subscribers:
                assert self._ctx is not None
                subscriber = NodeSubscriber(node_id, source, self.index, self._ctx, clock=self._clock)
                self.subscribers[node_id] = subscriber
                subscriber.start()

    def state(self, gateway_id: str, region: str) -> GatewayKVState:
        """This gateway's view of every node it subscribes to (what the dashboard shows)."""
        now = self._clock()
        return GatewayKVState(
            schema_version=SCHEMA_VERSION,
            gateway_id=gateway_id,
            region=region,
            updated_at=now,
            nodes={
                node_id: NodeKVState(
                    mode=subscriber.mode(now),
                    lag_s=subscriber.stats.last_lag_s,
                    blocks=self.index.blocks(node_id),
                    gaps=subscriber.stats.gaps,
                    received=subscriber.stats.received,
                )
                for node_id, subscriber in self.subscribers.items()
            },
        )

    async def report(
        self, redis: Any, keys: RedisKeys, gateway_id: str, region: str, stop: asyncio.Event
    ) -> None:
        """Every ``STATE_INTERVAL_S``, HSET this gateway's view (best effort; until ``stop``)."""
        failing = False
        reported = False
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), STATE_INTERVAL_S)
            if stop.is_set() or not (self.subscribers or reported):
                continue  # nothing to report (no node publishes events)
            try:
                async with asyncio.timeout(STATE_INTERVAL_S):
                    await redis.hset(keys.kv_state, gateway_id, encode(self.state(gateway_id, region)))
                reported = True
                failing = False
            except Exception as exc:  # Redis down: the dashboard shows no mode meanwhile
                if not failing:
                    logger.warning("cannot report KV-index state to Redis: %s", exc)
                failing = True
        if reported:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await redis.hdel(keys.kv_state, gateway_id)

    async def close(self) -> None:
        await self.sync({})
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


class KVEventsCollector(Collector):
    """Scrape-time metrics of the subscribers (names fixed in COORDINATION.md)."""

    def __init__(
        self,
        events: KVEvents,
        node_names: Callable[[], dict[int, str]],
        cached_tokens: Callable[[], Iterable[tuple[int, str, int, int]]] = tuple,
    ) -> None:
        self._events = events
        self._node_names = node_names
        self._cached_tokens = cached_tokens

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        names = self._node_names()
        now = time.time()
        received = CounterMetricFamily(
            "gorgo_kv_events_received", "KV events received from each node.", labels=["node"]
        )
        applied = CounterMetricFamily(
            "gorgo_kv_events_applied", "KV events applied to the precise index.", labels=["node"]
        )
        dropped = CounterMetricFamily(
            "gorgo_kv_events_dropped", "KV events not applied, by reason.", labels=["node", "reason"]
        )
        gaps = CounterMetricFamily(
            "gorgo_kv_event_sequence_gaps", "Sequence gaps in a node's event stream.", labels=["node"]
        )
        blocks = GaugeMetricFamily(
            "gorgo_kv_index_blocks", "Blocks the precise index holds per node.", labels=["node"]
        )
        lag = GaugeMetricFamily(
            "gorgo_kv_event_lag_seconds", "Age of the node's last event batch on arrival.", labels=["node"]
        )
        mode = GaugeMetricFamily(
            "gorgo_kv_index_precise",
            "1 while the node is routed on its events, 0 approximate.",
            labels=["node"],
        )
        for node_id, subscriber in sorted(self._events.subscribers.items()):
            name = names.get(node_id, str(node_id))
            stats = subscriber.stats
            received.add_metric([name], stats.received)
            applied.add_metric([name], stats.applied)
            for reason, count in sorted(stats.dropped.items()):
                dropped.add_metric([name, reason], count)
            gaps.add_metric([name], stats.gaps)
            blocks.add_metric([name], self._events.index.blocks(node_id))
            if stats.last_lag_s is not None:
                lag.add_metric([name], stats.last_lag_s)
            mode.add_metric([name], 1 if subscriber.mode(now) == "precise" else 0)
        yield from (received, applied, dropped, gaps, blocks, lag, mode)
        predicted = CounterMetricFamily(
            "gorgo_prefix_predicted_cached_tokens",
            "Cached prompt tokens the index predicted for the chosen node.",
            labels=["node", "mode"],
        )
        actual = CounterMetricFamily(
            "gorgo_prefix_actual_cached_tokens",
            "Cached prompt tokens the node reported (usage.prompt_tokens_details.cached_tokens).",
            labels=["node", "mode"],
        )
        for node_id, index_mode, predicted_tokens, actual_tokens in self._cached_tokens():
            name = names.get(node_id, str(node_id))
            predicted.add_metric([name, index_mode], predicted_tokens)
            actual.add_metric([name, index_mode], actual_tokens)
        yield predicted
        yield actual
