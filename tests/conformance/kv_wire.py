"""A small, independent reader of vLLM's KV-event wire format, for the conformance suite.

Deliberately not the gateway's decoder (that is what the suite protects) nor the emulator's
encoder: it states vLLM 0.32's format as observed (docs/vllm.md), so both targets are held to it.

- PUB message: three frames ``(topic, seq, payload)``; ``seq`` is 8 bytes big-endian, from 0 per
  process; ``payload`` is msgpack ``EventBatch`` = ``[ts, events, data_parallel_rank]`` (an array:
  vLLM's EventBatch is ``array_like``), each event a map tagged ``{"type": "BlockStored", ...}``
  (older encoders: an array with the tag first; both are accepted here).
- Replay: a DEALER sends ``(b"", start_seq)``; each reply is ``(b"", topic, seq, payload)``
  (the ROUTER sent ``(client_id, b"", topic, seq, payload)``), the last ``(b"", b"", -1, b"")``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

END_SEQ = -1
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)


@dataclass(frozen=True)
class Batch:
    topic: bytes
    seq: int
    ts: float
    events: list[dict[str, Any]]
    data_parallel_rank: int | None


def decode_event(raw: Any) -> dict[str, Any]:
    """One event as a dict with ``type``; arrays (legacy) are mapped onto vLLM's field order."""
    if isinstance(raw, dict):
        return raw
    tag, *values = raw
    if tag == "BlockStored":
        names = (*_STORED_FIELDS, "extra_keys", "group_idx")
    elif tag == "BlockRemoved":
        names = ("block_hashes", "medium", "group_idx")
    else:
        names = ()
    return {"type": tag, **dict(zip(names, values, strict=False))}


def decode_payload(topic: bytes, seq: int, payload: bytes) -> Batch:
    raw = msgspec.msgpack.decode(payload)
    if isinstance(raw, dict):  # the emulator's older map encoding of the batch
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        ts, events, *rest = raw
        rank = rest[0] if rest else None
    return Batch(topic, seq, ts, [decode_event(e) for e in events], rank)


def decode_message(frames: list[bytes]) -> Batch:
    assert len(frames) == 3, f"a PUB message is 3 frames (topic, seq, payload), got {len(frames)}"
    topic, seq, payload = frames
    assert len(seq) == 8
    return decode_payload(topic, int.from_bytes(seq, "big", signed=True), payload)


class Subscriber:
    """A SUB socket that connects (publisher binds) or binds (publisher connects)."""

    def __init__(self, endpoint: str, *, bind: bool = False) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            self.socket.bind(endpoint)
        else:
            self.socket.connect(endpoint)
        self.batches: list[Batch] = []

    def poll(self, timeout_s: float) -> list[Batch]:
        """Read every message that arrives within ``timeout_s`` (an upper bound)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.socket.poll(int(left * 1000) + 1):
                self.batches.append(decode_message(self.socket.recv_multipart()))
                # keep reading what is already queued, then return
                while self.socket.poll(200):
                    self.batches.append(decode_message(self.socket.recv_multipart()))
                return self.batches
        return self.batches

    def stored(self) -> list[dict[str, Any]]:
        return [e for b in self.batches for e in b.events if e["type"] == "BlockStored"]

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


def replay(endpoint: str, start_seq: int, timeout_s: float = 10.0) -> tuple[list[list[bytes]], list[bytes]]:
    """Ask for a replay from ``start_seq``; return the batch replies (frames as the DEALER got
    them) and the end frames."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
        replies: list[list[bytes]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not dealer.poll(int((deadline - time.monotonic()) * 1000) + 1):
                break
            frames = dealer.recv_multipart()
            if any(len(f) == 8 and int.from_bytes(f, "big", signed=True) == END_SEQ for f in frames[1:-1]):
                return replies, frames
            replies.append(frames)
        raise TimeoutError(f"no END_SEQ from {endpoint} within {timeout_s}s; got {len(replies)} replies")
    finally:
        dealer.close(0)
        context.term()


class GorgoWatcher:
    """gorgo's own side, for the restart test: its relay binds the address a connect-out engine
    sends to, and a gateway's subscriber manager (``KVEvents``) follows it, on an event loop in a
    thread (the conformance tests are synchronous). Records when the node's index emptied."""

    def __init__(self, listen: str, replay_endpoint: str, node_id: int = 1) -> None:
        import asyncio
        import threading

        self.node_id = node_id
        self.emptied_at: float | None = None  # unix s the index held no block after holding some
        self._held = False
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._listen = listen
        self._replay = replay_endpoint
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._main(),), daemon=True
        )
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("gorgo watcher did not start")

    async def _main(self) -> None:
        import asyncio

        from routing.cache.kv_events.manager import KVEvents
        from routing.cache.kv_events.subscriber import EventSource
        from routing.cache.kv_relay import KVRelay

        self._stop = asyncio.Event()
        self.relay = KVRelay(self._listen, "tcp://127.0.0.1:0")
        self.relay.start()
        self.events = KVEvents()
        await self.events.sync({self.node_id: EventSource(self.relay.publish_endpoint, self._replay)})
        self._ready.set()
        try:
            while not self._stop.is_set():
                blocks = self.events.index.blocks(self.node_id)
                if blocks:
                    self._held = True
                elif self._held and self.emptied_at is None:
                    self.emptied_at = time.time()
                try:
                    await asyncio.wait_for(self._stop.wait(), 0.005)
                except TimeoutError:
                    pass
        finally:
            await self.events.close()
            await self.relay.close()

    def blocks(self) -> int:
        return self.events.index.blocks(self.node_id)

    def mode(self) -> str:
        return self.events.mode(self.node_id)

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._loop.close()
