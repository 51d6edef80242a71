"""The gateway's subscriber to vLLM's KV-cache events (``--kv-events-config``), one per node.

The frames and batches are decoded by ``decoder``. Each ``NodeSubscriber`` (an asyncio task on the
gateway's loop) keeps its node's blocks in the shared ``PreciseIndex`` and decides the node's
**mode**:

- ``precise`` while its SUB socket is connected, its sequence is in order and its live events
  are fresh (lag under ``MAX_LAG_S``; replayed batches are as old as the buffer, not late). With a replay endpoint, from when the replay of what the node
  already holds is done (not while it is under way: its first batch alone would make a partial
  index look whole); without one, from the connection (blocks stored before it stay unknown:
  an under-estimate);
- ``approximate`` otherwise: before the first connection, while disconnected (the node may be
  restarting), for ``RESYNC_S`` after a sequence gap that replay could not fill (the index then
  restarts empty), while events lag, and while the node is **silent**: it answered
  ``SILENT_MIN_REQUESTS`` requests through this gateway, the first ``SILENT_AFTER_S`` ago, and no
  event came since (logged once with ``ENDPOINT_SHAPE_RULE``, the usual cause).

Sequence rules: a disconnection empties the node (its process may be gone), and so does the
relay's ``PUBLISHER_GONE_SEQ`` (the node's vLLM disconnected from the relay; approximate until it
publishes again or the relay's ``PUBLISHER_JOINED_SEQ`` says it connected, and then replayed from 0:
the same process may be back, its cache intact); every (re)connection empties it and replays from 0 (a reconnect may be a
restarted vLLM), and again from the expected batch ``CATCH_UP_AFTER_S`` later (ZMQ's slow joiner:
what the PUB socket sent before the subscription reached it is lost with no gap to show it). A live sequence number not above the previous live one means the publisher
restarted (vLLM 0.32 starts every process at 0 and sends no ``AllBlocksCleared``): the node is
emptied at once and the new process's earlier batches replayed from 0. Through a relay (the node
connects out, ``routing.cache.kv_relay``) the gateway's own connection never drops, so this is the
only sign of a restart. A live number below the expected one but above the previous live one was
already applied through replay; a higher one is a gap (replay from the expected one; if the
publisher's buffer no longer has it, empty and count it). ``AllBlocksCleared`` empties it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from routing.cache.kv_events.decoder import BatchError, Removed, Stored, decode_batch
from routing.cache.kv_relay import PUBLISHER_GONE_SEQ, PUBLISHER_JOINED_SEQ
from routing.cache.precise_index import PreciseIndex
from routing.contract import KVEventsSpec

logger = logging.getLogger("routing.kv_events")

Mode = Literal["precise", "approximate"]
MAX_LAG_S = 5.0  # events older than this on arrival: the node is treated as approximate
RESYNC_S = 30.0  # after an unrecoverable gap, approximate for this long while the index refills
REPLAY_TIMEOUT_S = 2.0
# After a (re)connection's replay, replay again from the expected batch this long after it: ZMQ
# drops what a PUB socket sends before the new subscription reaches it (the "slow joiner"), so a
# batch published just after the replay can be lost with no later batch to show the gap.
CATCH_UP_AFTER_S = (0.5, 2.0)
END_SEQ = -1
# A node this gateway sent SILENT_MIN_REQUESTS answered requests, the first SILENT_AFTER_S ago,
# without one event since: its events do not reach us (most often the endpoint shape, below).
SILENT_MIN_REQUESTS = 3
SILENT_AFTER_S = 60.0
ENDPOINT_SHAPE_RULE = (
    "vLLM binds its KV-events endpoint only when it contains '*', '::' or ipc:// (tcp://*:PORT) and "
    "otherwise connects out to it: gateways connect to a bound one (tcp://NODE_HOST:PORT), and a "
    "connect-out endpoint must be bound by gorgo's relay (python -m routing.cache.kv_relay), which "
    "gateways then subscribe to"
)


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
    restarts: int = 0  # the sequence went back: a new publisher process
    last_restart_at: float | None = None  # unix s the last restart was seen (its index emptied)
    publisher_gone_at: float | None = None  # unix s the relay last said the node's vLLM disconnected
    last_lag_s: float | None = None
    last_event_at: float | None = None  # unix s of the last batch received
    connected: bool = False
    served_since_event: int = 0  # requests the node answered through this gateway since the last batch
    waiting_since: float | None = None  # unix s of the first of those


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one node publishes (from the snapshot's ``NodeSpec.kv_events_endpoint``)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @classmethod
    def of_node(cls, spec: KVEventsSpec, base_url: str) -> EventSource:
        """The node's endpoints as this gateway connects to them: vLLM's own ``tcp://*:P`` (what it
        binds) names the node's host, taken from its ``base_url``."""
        host = urlsplit(base_url).hostname or "127.0.0.1"
        return cls(
            connectable(spec.endpoint, host),
            connectable(spec.replay_endpoint, host) if spec.replay_endpoint else None,
            spec.topic,
        )


def connectable(endpoint: str, node_host: str) -> str:
    """``tcp://*:P``, ``tcp://0.0.0.0:P`` or ``tcp://[::]:P`` (a bind address) -> ``tcp://NODE_HOST:P``."""
    if not endpoint.startswith("tcp://"):
        return endpoint  # ipc:// is a path on the node's host: usable as it is
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host not in ("*", "0.0.0.0", "::", "[::]"):
        return endpoint
    return f"tcp://[{node_host}]:{port}" if ":" in node_host else f"tcp://{node_host}:{port}"


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
        self._last_live_seq: int | None = None  # the last sequence number the live stream brought
        self._resync_until = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._silent_logged = False
        self._publisher_gone = False  # the relay said the node's vLLM disconnected
        self._replaying = False  # a replay is applying batches: the index is not yet whole
        self._catch_ups: list[float] = []  # loop times of the replays still due after a connection

    # ---- mode ---------------------------------------------------------------------------------

    def note_served(self, now_s: float) -> None:
        """The node answered a request this gateway sent it that must have stored a block (the
        caller, ``KVAwareIndex.note_served``, leaves out short and wholly cached prompts)."""
        stats = self.stats
        stats.served_since_event += 1
        if stats.waiting_since is None:
            stats.waiting_since = now_s

    def silent(self, now_s: float) -> bool:
        """Requests were served and no event came for ``SILENT_AFTER_S``: the events are lost."""
        stats = self.stats
        silent = (
            stats.served_since_event >= SILENT_MIN_REQUESTS
            and stats.waiting_since is not None
            and now_s - stats.waiting_since >= SILENT_AFTER_S
        )
        if silent and not self._silent_logged:
            self._silent_logged = True
            logger.warning(
                "node %s answered %d requests through this gateway in %.0f s and sent no KV event on "
                "%s; it is routed approximately. %s.",
                self.node_id,
                stats.served_since_event,
                now_s - stats.waiting_since,
                self.source.endpoint,
                ENDPOINT_SHAPE_RULE,
            )
        return silent

    def mode(self, now_s: float) -> Mode:
        stats = self.stats
        if not stats.connected or now_s < self._resync_until or self._publisher_gone or self.silent(now_s):
            return "approximate"
        if self._replaying or (self._expected is None and self.source.replay_endpoint):
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
        loop = asyncio.get_running_loop()
        try:
            while True:
                timeout = max(0.0, self._catch_ups[0] - loop.time()) * 1000 if self._catch_ups else None
                ready = dict(await poller.poll(timeout))
                if self._catch_ups and loop.time() >= self._catch_ups[0]:
                    del self._catch_ups[0]
                    await self._catch_up()
                if monitor in ready:
                    await self._on_monitor(await monitor.recv_multipart())
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        self.stats.dropped["malformed"] += 1
                        continue
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if seq < 0:  # the relay's markers; vLLM's own sequence starts at 0
                        if seq == PUBLISHER_GONE_SEQ:
                            self._on_publisher_gone()
                        elif seq == PUBLISHER_JOINED_SEQ:
                            await self._on_publisher_joined()
                        else:
                            self.stats.dropped["malformed"] += 1
                        continue
                    await self._on_message(seq, frames[2])
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
            self._last_live_seq = None
            self.stats.connected = True
            await self._start_over()
        elif event == zmq.EVENT_DISCONNECTED:
            # The node stopped or restarts: what it held is gone with the process (or will be
            # replayed on reconnection). Forget it now, not at reconnection.
            self.stats.connected = False
            self._catch_ups = []
            self._reset(count=False)

    async def _catch_up(self) -> None:
        """Replay what the live stream may have missed while the subscription was on its way."""
        expected = self._expected
        if not self.stats.connected or expected is None or self._publisher_gone:
            return
        # Not answered, or the buffer no longer reaches back: the next live batch shows the gap
        # and its handling (replay, else empty and resync) applies.
        if (
            await self._replay(expected, partial=False)
            and self._expected is not None
            and self._expected > expected
        ):
            self.stats.gaps += 1
            logger.info(
                "KV events of node %s: %d batches published before this gateway's subscription took "
                "effect were replayed",
                self.node_id,
                self._expected - expected,
            )

    async def _start_over(self) -> bool:
        """Replay what the publisher holds from 0, and again ``CATCH_UP_AFTER_S`` later; False if
        the replay did not answer (or there is no replay endpoint)."""
        if not self.source.replay_endpoint:
            return False
        replayed = await self._replay(0)
        now = asyncio.get_running_loop().time()
        self._catch_ups = [now + delay for delay in CATCH_UP_AFTER_S]
        return replayed

    async def _on_publisher_joined(self) -> None:
        """The relay saw a vLLM connect (a new process, or the same one back): with a replay
        endpoint, what it holds is replayed now, not at its next batch (which ZMQ may also drop:
        the node's PUB drops what it sends before the relay's subscription reaches it)."""
        if not self.source.replay_endpoint:
            return  # approximate until its first batch, which starts it over (_on_publisher_gone)
        self._publisher_gone = False
        self._reset(count=False)
        self._last_live_seq = None
        if not await self._start_over():
            self._await_first_batch()  # not answered: as before it joined

    def _on_publisher_gone(self) -> None:
        """The relay saw the node's vLLM disconnect: empty, approximate until it publishes again."""
        self.stats.publisher_gone_at = self._clock()
        self._await_first_batch()

    def _await_first_batch(self) -> None:
        """Empty, approximate until the node's vLLM publishes (behind the relay: its connection
        is not ours, so only its first batch, or the relay's join, says it is back)."""
        self._publisher_gone = True
        self._reset(count=False)
        self._last_live_seq = None
        if self.source.replay_endpoint:
            # Whoever publishes next has its earlier batches in its replay buffer: a new process
            # from 0, or the same one back from a dropped connection, its cache intact and its
            # sequence continuing. Its first batch replays them (a gap from 0).
            self._expected = 0

    def _on_restart(self, seq: int) -> None:
        self.stats.restarts += 1
        self.stats.last_restart_at = self._clock()
        logger.info(
            "KV events of node %s: sequence went back to %d, a restarted vLLM; its blocks are forgotten",
            self.node_id,
            seq,
        )
        self._reset(count=False)
        # The new process's batches before this one are in its replay buffer (a gap from 0).
        self._expected = 0

    def _reset(self, *, count: bool) -> None:
        self._index.clear(self.node_id)
        self._expected = None
        if count:
            self.stats.resets += 1

    async def _on_message(self, seq: int, payload: bytes) -> None:
        self._publisher_gone = False
        last_live = self._last_live_seq
        self._last_live_seq = seq
        if last_live is not None and seq <= last_live:
            # One publisher's live stream only goes up: lower is a new process (vLLM starts at 0
            # and sends no AllBlocksCleared), whose cache is empty. Start over at once.
            self._on_restart(seq)
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

    def _apply(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        """Apply one batch; ``live`` False for a replayed one, whose age is not lag (the replay
        buffer holds batches of any age)."""
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
        stats.served_since_event = 0
        stats.waiting_since = None
        self._silent_logged = False
        if live:
            stats.last_lag_s = max(0.0, now - batch.ts)
        if batch.unknown:
            stats.dropped["unknown_event"] += batch.unknown
        index = self._index
        node_id = self.node_id
        for event in batch.events:
            if isinstance(event, Stored):
                unkeyed = index.store(
                    node_id,
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    event.block_size,
                    event.extra_keys,
                    event.lora_name,
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

    async def _replay(self, start: int, until: int | None = None, *, partial: bool = True) -> bool:
        """Apply the publisher's buffered batches from ``start`` (below ``until``).

        False when the replay timed out, or when ``start`` > 0 and the buffer no longer reaches
        back to it. From 0, whatever the buffer holds is the best there is: True. ``partial``: the
        index is known not to be whole until it ends (the node is approximate meanwhile); a
        catch-up, which only looks for what might have been missed, is not.
        """
        self.stats.replays += 1
        self._replaying = partial
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
                # vLLM 0.32: [b"", topic, seq, payload] (the end: [b"", b"", END_SEQ, b""]); before
                # 0.32: [b"", seq, payload]. The sequence number is the next-to-last frame in both.
                if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                    self.stats.dropped["malformed_replay"] += 1
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
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
                    self._apply(seq, frames[-1], live=False)
        finally:
            self._replaying = False
            dealer.close(linger=0)
