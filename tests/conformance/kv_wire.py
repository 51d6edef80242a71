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
