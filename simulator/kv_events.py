"""vLLM's KV-cache events, published by the emulated engine exactly as vLLM 0.32 puts them on the wire.

vLLM (``vllm/distributed/kv_events.py``, ``vllm/config/kv_events.py``), enabled by
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'``.
Observed on a real vLLM 0.32.0 (docs/vllm.md; pinned by tests/conformance on both):

- A ZMQ PUB socket sends one message per engine step that changed the cache, three frames:
  the topic, the sequence number (8 bytes, big-endian, from 0 for each process), and the msgpack
  payload ``EventBatch`` = ``[ts, events, data_parallel_rank]``.
- Events: ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind}`` when full blocks become cached,
  ``BlockRemoved{block_hashes, medium, group_idx}`` when cached blocks are evicted,
  ``AllBlocksCleared{}`` when the prefix cache is reset. ``extra_keys`` has one entry per block:
  ``[cache_salt]`` on a salted request's first block (the salt is hashed there, and the chain
  carries it on), else null; ``lora_name`` names the request's LoRA adapter.
- Encodings: older vLLM encodes each event as a positional array with its tag first
  (``"legacy"``); 0.32 encodes each as a map with the tag under ``"type"`` (``"map"``), inside
  the array batch. Selectable per node here (the simulator-only key ``encoding``).
- Bind or connect by the endpoint's shape, as vLLM: an endpoint with ``*`` or ``::`` (or
  ``ipc://``, ``inproc://``) is bound; any other address is connected to, and the consumer binds.
- Optional replay on a ROUTER socket (``replay_endpoint``, always bound): a DEALER sends
  ``(b"", start_seq)`` (8 bytes, big-endian); 0.32 answers ``(client_id, b"", topic, seq,
  payload)`` per buffered batch from there (the last ``buffer_steps``) and ends with
  ``(client_id, b"", b"", -1, b"")``. Older vLLM answered ``(client_id, b"", seq, payload)``;
  the simulator-only key ``replay_format: "pre-0.32"`` speaks that, for gateway tests.
- With data parallelism each rank publishes on the base port + its rank.

Block hashes chain from a random root drawn per engine start, so a router cannot recompute them:
it must key blocks by the ``token_ids`` (and ``extra_keys``, ``lora_name``) the events carry.
(vLLM 0.32's default sha256 hashing uses a fixed seed, so its hashes repeat across processes; the
emulator's do not, which a consumer must not rely on either way.) Hashes are unsigned 64-bit
integers, as vLLM 0.32 sends by default.

One difference from vLLM: an endpoint with ``*`` binds on the node's own listen address (127.0.0.1
by default) instead of every interface, so the emulated fleet stays on loopback; port 0 picks a
free port (``Publisher.endpoint`` tells which).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

Encoding = Literal["legacy", "map"]
ENCODINGS: tuple[Encoding, ...] = ("legacy", "map")
# How a replay reply is framed. vLLM 0.32: the ROUTER sends (client_id, b"", topic, seq, payload)
# per batch and (client_id, b"", b"", END_SEQ, b"") last, so a DEALER receives four frames
# (b"", topic, seq, payload). Before 0.32: (client_id, b"", seq, payload), the DEALER gets three.
ReplayFormat = Literal["v0.32", "pre-0.32"]
REPLAY_FORMATS: tuple[ReplayFormat, ...] = ("v0.32", "pre-0.32")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


class KVEventsConfigError(ValueError):
    """A ``--kv-events-config`` value is not valid JSON or has a bad key or value."""


_REBIND_WAIT_S = 2.0  # how long a restarting publisher waits for its old port to be released


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (same keys and defaults), plus the simulator's ``encoding``."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: Encoding = "map"
    replay_format: ReplayFormat = "v0.32"

    @property
    def enabled(self) -> bool:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"


def parse_kv_events_config(raw: str | Mapping[str, Any]) -> KVEventsConfig:
    """Parse the JSON of ``--kv-events-config`` (or a TOML table); unknown keys are errors."""
    if isinstance(raw, str):
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise KVEventsConfigError(f"kv_events_config is not valid JSON: {exc}") from None
    else:
        data = dict(raw)
    if not isinstance(data, dict):
        raise KVEventsConfigError("kv_events_config must be a JSON object")
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise KVEventsConfigError(f"kv_events_config has unknown key(s) {unknown}; known: {sorted(known)}")
    types = {
        "enable_kv_cache_events": bool,
        "buffer_steps": int,
        "hwm": int,
        "max_queue_size": int,
        "endpoint": str,
        "topic": str,
    }
    for key, expected in types.items():
        if key in data and (
            not isinstance(data[key], expected) or (expected is int and isinstance(data[key], bool))
        ):
            raise KVEventsConfigError(
                f"kv_events_config.{key} must be {expected.__name__}, got {data[key]!r}"
            )
    if data.get("publisher") not in (None, "null", "zmq"):
        raise KVEventsConfigError(
            f"kv_events_config.publisher must be 'zmq' or 'null', got {data['publisher']!r}"
        )
    if data.get("replay_format", "v0.32") not in REPLAY_FORMATS:
        raise KVEventsConfigError(
            f"kv_events_config.replay_format must be one of {REPLAY_FORMATS}, got {data['replay_format']!r}"
        )
    if data.get("encoding", "map") not in ENCODINGS:
        raise KVEventsConfigError(
            f"kv_events_config.encoding must be one of {ENCODINGS}, got {data['encoding']!r}"
        )
    replay = data.get("replay_endpoint")
    if replay is not None and not isinstance(replay, str):
        raise KVEventsConfigError("kv_events_config.replay_endpoint must be a string")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if key in data and data[key] < 1:
            raise KVEventsConfigError(f"kv_events_config.{key} must be positive")
    config = KVEventsConfig(**data)
    for key, endpoint in (("endpoint", config.endpoint), ("replay_endpoint", config.replay_endpoint)):
        if endpoint is not None and config.enabled:
            _split_tcp(endpoint, key)
    if config.enabled and not binds(config.endpoint) and _split_tcp(config.endpoint, "endpoint")[1] == 0:
        raise KVEventsConfigError(
            f"kv_events_config.endpoint {config.endpoint!r} is connected to (no '*'): it needs a real port"
        )
    return config


def _split_tcp(endpoint: str, key: str) -> tuple[str, int]:
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise KVEventsConfigError(f"kv_events_config.{key} must be tcp://HOST:PORT, got {endpoint!r}")
    host, _, port = endpoint[6:].rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise KVEventsConfigError(f"kv_events_config.{key} has a bad port: {endpoint!r}")
    return host, int(port)


def binds(endpoint: str) -> bool:
    """vLLM's rule (``ZmqEventPublisher._is_bind_endpoint``): an endpoint with ``*`` or ``::``
    (or ``ipc://``/``inproc://``) is bound; any other address is CONNECTED to, so whoever
    consumes the events must bind it. Replay endpoints are always bound."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """vLLM's rule: data-parallel rank r publishes on the base port + r (port 0 stays 0)."""
    host, port = _split_tcp(endpoint, "endpoint")
    if data_parallel_rank == 0 or port == 0:
        return endpoint
    return f"tcp://{host}:{port + data_parallel_rank}"


# ---------------------------------------------------------------------------------------------
# Events, as the engine reports them, and their two wire encodings
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that became cached. ``extra_keys``: one entry per block, what vLLM hashed with
    the block's tokens beyond them (``(cache_salt,)`` on a salted request's first block, else
    None); ``lora_name``: the request's LoRA adapter (None: the base model)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(events: list[Event], ts: float, data_parallel_rank: int, encoding: Encoding) -> bytes:
    """The msgpack payload of one ``EventBatch``, in vLLM's legacy (arrays) or map encoding.

    ``map`` is vLLM 0.32's wire format as observed (docs/vllm.md): the batch is an ARRAY
    ``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch`` is ``array_like``), each event a
    map tagged ``"type"`` with defaults omitted; block hashes are unsigned 64-bit integers (vLLM's
    default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); ``extra_keys`` has one entry per block.
    """
    if encoding == "legacy":
        encoded: list[Any] = []
        for event in events:
            if isinstance(event, BlockStored):
                stored: list[Any] = [
                    "BlockStored",
                    list(event.block_hashes),
                    event.parent_block_hash,
                    list(event.token_ids),
                    event.block_size,
                    None,  # lora_id
                    MEDIUM_GPU,
                    event.lora_name,
                ]
                if event.extra_keys is not None:
                    stored.append([None if k is None else list(k) for k in event.extra_keys])
                encoded.append(stored)
            elif isinstance(event, BlockRemoved):
                encoded.append(["BlockRemoved", list(event.block_hashes), MEDIUM_GPU])
            else:
                encoded.append(["AllBlocksCleared"])
        return msgspec.msgpack.encode([ts, encoded, data_parallel_rank])
    maps: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, BlockStored):
            stored_map: dict[str, Any] = {
                "type": "BlockStored",
                "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash,
                "token_ids": list(event.token_ids),
                "block_size": event.block_size,
                "lora_id": None,
                "medium": MEDIUM_GPU,
                "lora_name": event.lora_name,
            }
            if event.extra_keys is not None:
                stored_map["extra_keys"] = [None if k is None else list(k) for k in event.extra_keys]
            stored_map["group_idx"] = 0
            stored_map["kv_cache_spec_kind"] = "full_attention"
            maps.append(stored_map)
        elif isinstance(event, BlockRemoved):
            maps.append(
                {
                    "type": "BlockRemoved",
                    "block_hashes": list(event.block_hashes),
                    "medium": MEDIUM_GPU,
                    "group_idx": 0,
                }
            )
        else:
            maps.append({"type": "AllBlocksCleared"})
    return msgspec.msgpack.encode([ts, maps, data_parallel_rank])


# ---------------------------------------------------------------------------------------------
# The publisher
# ---------------------------------------------------------------------------------------------


class Publisher:
    """One engine's (one data-parallel rank's) PUB socket and replay ROUTER socket.

    ``publish`` never blocks the engine: past the high-water mark ZMQ drops, as vLLM's does.
    """

    def __init__(self, config: KVEventsConfig, host: str, *, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._host = host
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._topic = config.topic.encode()
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.endpoint: str | None = None  # as bound, with the real port
        self.replay_endpoint: str | None = None
        self.batches_sent = 0

    def _bind(self, socket: zmq.Socket[Any], endpoint: str, previous: str | None) -> str:
        host, port = _split_tcp(offset_endpoint(endpoint, self.data_parallel_rank), "endpoint")
        if not binds(endpoint):  # vLLM connects out to such an endpoint; a subscriber binds there
            socket.connect(f"tcp://{host}:{port}")
            return f"tcp://{host}:{port}"
        if host in ("*", "0.0.0.0", ""):
            host = self._host
        if previous is not None:  # a restart keeps the port it had
            port = int(previous.rpartition(":")[2])
        address = f"tcp://{host}:{port if port else '*'}"
        # ZMQ closes a socket on its I/O thread, after close() returns: a restart re-binding the
        # port its previous socket held can find it still taken for a moment. Wait (bounded).
        deadline = time.monotonic() + (_REBIND_WAIT_S if previous is not None else 0.0)
        while True:
            try:
                socket.bind(address)
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)
        return socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self, host: str | None = None) -> None:
        """Bind (``host`` replaces ``*`` in the endpoints); a restart reuses the earlier ports."""
        if host is not None:
            self._host = host
        config = self.config
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            self.endpoint = self._bind(pub, config.endpoint, self.endpoint)
            if config.replay_endpoint is not None:
                replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                try:
                    # vLLM binds the replay endpoint whatever its shape.
                    replay_endpoint = config.replay_endpoint
                    if not binds(replay_endpoint):
                        replay_endpoint = "tcp://*:" + replay_endpoint.rpartition(":")[2]
                    self.replay_endpoint = self._bind(replay, replay_endpoint, self.replay_endpoint)
                except BaseException:
                    replay.close()
                    raise
                self._replay = replay
                self._replay_task = asyncio.get_running_loop().create_task(
                    self._serve_replay(replay), name="simulator-kv-replay"
                )
        except BaseException:
            pub.close()
            raise
        self._pub = pub
        self._seq = 0
        self._buffer.clear()

    async def stop(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None

    def publish(self, events: list[Event]) -> None:
        """Send one batch (one engine step's changes) with the next sequence number."""
        if self._pub is None or not events:
            return
        seq = self._seq
        self._seq += 1
        payload = encode_batch(events, time.time(), self.data_parallel_rank, self.config.encoding)
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self.batches_sent += 1

    async def _serve_replay(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignoring an invalid KV-event replay request (%d frames)", len(frames))
                continue
            client, delimiter, start = frames
            start_seq = int.from_bytes(start, "big")
            if self.config.replay_format == "pre-0.32":
                for seq, payload in list(self._buffer):
                    if seq >= start_seq:
                        await socket.send_multipart((client, delimiter, seq.to_bytes(8, "big"), payload))
                await socket.send_multipart((client, delimiter, END_SEQ, b""))
                continue
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await socket.send_multipart(
                        (client, delimiter, self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await socket.send_multipart((client, delimiter, b"", END_SEQ, b""))
