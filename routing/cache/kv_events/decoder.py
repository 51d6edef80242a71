"""vLLM's KV-event batches, decoded: the wire format, nothing about sockets or sequences.

Wire format (vLLM ``vllm/distributed/kv_events.py``): ZMQ PUB, three frames per message (topic,
sequence number as 8 bytes big-endian, msgpack ``EventBatch``). The batch and its events come in
two encodings, both decoded here: positional arrays with the event's tag first (vLLM before
2026-06) and maps with the tag under ``"type"``. Fields keep being added to both: positions past
the ones read and unknown map keys are ignored, and unknown event types are counted as dropped.
Block hashes are integers or byte strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    extra_keys: list[Any] | None = None  # 0.32: one entry per block (cache_salt, LoRA name, ...)
    lora_name: str | None = None


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


def _extra_keys(value: Any) -> list[Any] | None:
    # All null (no tenant on any block) is the same as absent: the plain key, the fast path.
    if not isinstance(value, list) or all(entry is None for entry in value):
        return None
    return value


def _lora_name(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


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
                _extra_keys(event[8] if len(event) > 8 else None),
                _lora_name(event[7] if len(event) > 7 else None),
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
                _extra_keys(event.get("extra_keys")),
                _lora_name(event.get("lora_name")),
            )
        if tag == "BlockRemoved":
            return Removed([_engine_key(h, medium) for h in event["block_hashes"]], medium)
        if tag == "AllBlocksCleared":
            return Cleared()
        return None
    raise TypeError("event is neither an array nor a map")
