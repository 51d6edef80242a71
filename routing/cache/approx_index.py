"""An approximate, per-node index of the prompt prefixes this fleet has sent to each node.

vLLM caches KV blocks under chained block hashes (a block's hash covers its tokens and its whole
prefix). The gateway cannot see token ids, so it mirrors the idea on the rendered prompt text:

- The UTF-8 bytes of the prompt are cut into fixed chunks of ``CHUNK_BYTES`` (characters, for
  ASCII); a trailing partial chunk is ignored, as vLLM ignores a partial block.
- Chunk ``i``'s hash is xxh3-64 of the chunk seeded with chunk ``i-1``'s hash, so one hash names a
  whole prefix and equal hashes mean equal prefixes. xxh3 is stable across processes and machines
  (Python's ``hash()`` is salted per process), which is what lets gateways share hashes.
- Per node, the index remembers which chunk hashes were sent there, with the time last sent, in
  LRU order (one ``OrderedDict`` per node), sized to the node's KV capacity (``kv_capacity_tokens`` / tokens per chunk, where a
  chunk is ``CHUNK_BYTES / chars_per_token`` tokens). Entries older than ``ttl_s`` never match.
- A prompt's chunks are touched tail first, so a shared prefix is always at least as recent as
  anything that extends it and is evicted last (vLLM frees a request's blocks tail first for the
  same reason). Hence what a node holds of one prompt is always a prefix of its chunks, and the
  matched length is found by binary search instead of a walk over every chunk.
- Which nodes hold a chunk is one integer bitmask per chunk hash (a bit per node slot), so a
  bisection step is a dict lookup and an AND, and the index holds no per-chunk container objects
  for the cyclic garbage collector to scan (with millions of entries, such scans stall the event
  loop for milliseconds).

Matching is pure: time comes in as ``now_s`` (unix seconds, so timestamps from other gateways
compare). ``match``/``insert`` are the gateway's text-level hook (``routing.cache.prompt.PrefixIndex``);
they read the injected clock and reuse the hashes of the last prompt, so a request hashes its
prompt once. Another index (e.g. one fed by vLLM's ``--kv-events-config``) can replace this one by
implementing the same hook.

Trust (the miss-snowball guard, docs/routing.md): after a request the gateway reports what the
node said it had cached (``observe``); a node whose real hits fall short of what the index
predicted gets its cache credit scaled down, so a node whose cache thrashes stops attracting
"cache hits" that are really full prefills. Distrust fades with a half-life, so a recovered node
earns its credit back.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import xxhash
from mypy_extensions import mypyc_attr

from routing.cache.prompt import DEFAULT_CHARS_PER_TOKEN
from routing.contract import NodeSpec, PrefixUpdate

# 256 bytes (~64 tokens at 4 chars per token): hashing a 32k-character prompt costs ~15 us; 64-byte
# chunks (vLLM's 16-token blocks) cost ~45 us for a finer match that prompts of thousands of
# tokens do not need. Measured in benchmarks/routing_decision.py. Every gateway of a fleet must use
# the same chunk size and hash, or they cannot share.
CHUNK_BYTES: Final = 256
DEFAULT_TTL_S: Final = 600.0
# Capacity of a node the index has not been told about (sync_nodes fixes it at the next snapshot).
DEFAULT_CAPACITY_TOKENS: Final = 65_536
# Insertions kept for the sharing task; beyond this the oldest are dropped (sharing is best-effort).
OUTBOX_MAX: Final = 4096
# Weight of one observation in a node's trust, and how fast distrust fades.
TRUST_ALPHA: Final = 0.3
TRUST_HALF_LIFE_S: Final = 30.0

_hash_chunk = xxhash.xxh3_64_intdigest


def chunk_hashes(prompt_text: str) -> list[int]:
    """The chained hashes of the prompt's full chunks, first chunk first (stable across processes)."""
    if len(prompt_text) * 4 < CHUNK_BYTES:  # at most 4 UTF-8 bytes a character: not one full chunk
        return []
    data = prompt_text.encode("utf-8", "surrogatepass")
    view = memoryview(data)
    hashes: list[int] = []
    append_hash = hashes.append
    parent = 0
    for start in range(0, len(data) - CHUNK_BYTES + 1, CHUNK_BYTES):
        parent = _hash_chunk(view[start : start + CHUNK_BYTES], parent)
        append_hash(parent)
    return hashes


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled (routing/native.py); tests subclass it
class ApproxPrefixIndex:
    """Chunk-hash prefix index per node, LRU-sized to each node's KV capacity, with a TTL.

    Implements the gateway's ``PrefixIndex`` hook (``match``/``insert`` on prompt text) on top of
    the hash-level API (``chunk_hashes``/``match_hashes``/``insert_hashes``) that sharing and
    benchmarks use.
    """

    def __init__(
        self,
        *,
        chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
        ttl_s: float = DEFAULT_TTL_S,
        default_capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not chars_per_token > 0:
            raise ValueError(f"chars_per_token must be positive, got {chars_per_token!r}")
        self.ttl_s = ttl_s
        self.default_capacity_tokens = default_capacity_tokens
        self._clock = clock
        self._chunk_tokens = CHUNK_BYTES / chars_per_token
        # chunk hash -> bitmask of the node slots it was sent to
        self._holders: dict[int, int] = {}
        # node id -> its chunk hashes -> unix seconds last sent there, least recently sent first
        self._lru: dict[int, OrderedDict[int, float]] = {}
        self._slot_of: dict[int, int] = {}  # node id -> bit position in the masks
        self._node_in_slot: dict[int, int] = {}
        self._free_slots: list[int] = []
        self._masks: dict[tuple[int, ...], int] = {}  # candidate tuple -> its bitmask (cached)
        self._kv_tokens: dict[int, int] = {}
        self._capacity_chunks: dict[int, int] = {}
        self._trust: dict[int, tuple[float, float]] = {}  # node id -> (trust, unix s of last update)
        self._outbox: deque[tuple[int, tuple[int, ...], float]] = deque(maxlen=OUTBOX_MAX)
        self._last_text: str | None = None
        self._last_hashes: list[int] = []

    # ---- hashing ------------------------------------------------------------------------------

    @property
    def chunk_tokens(self) -> float:
        """Estimated tokens per chunk (``CHUNK_BYTES / chars_per_token``)."""
        return self._chunk_tokens

    def chunk_hashes(self, prompt_text: str) -> list[int]:
        """The prompt's chained chunk hashes; compute once per request and pass them around."""
        return chunk_hashes(prompt_text)

    def text_hashes(self, prompt_text: str) -> list[int]:
        """The prompt's chunk hashes, hashed once per prompt object: the gateway calls match(),
        insert() and then keeps them for the request's record, all with the same string."""
        if prompt_text is not self._last_text:
            self._last_hashes = chunk_hashes(prompt_text)
            self._last_text = prompt_text
        return self._last_hashes

    # ---- the gateway's hook (routing.cache.prompt.PrefixIndex) ------------------------------------------

    def match(
        self, node_ids: Sequence[int], prompt_text: str, prompt_ids: Sequence[int] | None = None
    ) -> dict[int, int]:
        """Node id -> estimated cached prefix tokens, for the nodes that hold some of the prompt.

        Works on the text only; ``prompt_ids`` is for precise indexes (``routing.cache.kv_aware_index``).
        """
        hashes = self.text_hashes(prompt_text)
        if not hashes:  # shorter than a chunk: nothing to match, no clock to read
            return {}
        return self.match_hashes(hashes, node_ids, self._clock())

    def insert(self, node_id: int, prompt_text: str) -> None:
        """Record that the prompt was sent to ``node_id`` (and queue it for the other gateways)."""
        hashes = self.text_hashes(prompt_text)
        if hashes:  # shorter than a chunk: nothing to record
            self.insert_hashes(node_id, hashes, self._clock())

    # ---- hash level ---------------------------------------------------------------------------

    def match_hashes(self, hashes: Sequence[int], node_ids: Iterable[int], now_s: float) -> dict[int, int]:
        """Node id -> cached prefix tokens (scaled by the node's trust); nodes with none are absent.

        Pure in time: entries last sent before ``now_s - ttl_s`` do not count.
        """
        if not hashes:
            return {}
        holders = self._holders
        first = holders.get(hashes[0], 0)
        if not first:
            return {}
        pending = first & self._mask(node_ids)  # candidates holding chunk 0 (fresh or not)
        cutoff = now_s - self.ttl_s
        matched_chunks: dict[int, int] = {}
        node_in_slot = self._node_in_slot
        lru_of = self._lru
        high = len(hashes)  # every pending node holds chunk 0 and none holds chunk `high`
        while pending:
            # Largest i < high whose chunk some pending node holds. "Holds chunk i" is monotone
            # (a prefix) per node, so the predicate is monotone in i and bisection is exact.
            low = high - 1
            if not holders.get(hashes[low], 0) & pending:
                low, top = 0, low  # chunk 0: held; chunk `top`: not
                while top - low > 1:
                    mid = (low + top) >> 1
                    if holders.get(hashes[mid], 0) & pending:
                        low = mid
                    else:
                        top = mid
            chunk = hashes[low]
            found = holders[chunk] & pending
            pending ^= found
            while found:
                bit = found & -found
                found ^= bit
                node_id = node_in_slot[bit.bit_length() - 1]
                if lru_of[node_id][chunk] >= cutoff:
                    matched_chunks[node_id] = low + 1
                else:
                    # Rare (inserts expire old entries): times never increase along a chain, so
                    # the fresh part is a prefix too.
                    fresh = self._fresh_prefix(hashes, lru_of[node_id], cutoff, low)
                    if fresh:
                        matched_chunks[node_id] = fresh
            high = low
        chunk_tokens = self._chunk_tokens
        trust = self._trust
        result: dict[int, int] = {}
        for node_id, chunks in matched_chunks.items():
            tokens = chunks * chunk_tokens
            if node_id in trust:
                tokens *= self.trust(node_id, now_s)
            if tokens >= 1:
                result[node_id] = int(tokens)
        return result

    def _mask(self, node_ids: Iterable[int]) -> int:
        """The slot bitmask of a set of node ids (cached per candidate tuple)."""
        key = node_ids if isinstance(node_ids, tuple) else tuple(node_ids)
        mask = self._masks.get(key)
        if mask is None:
            mask = 0
            for node_id in key:
                slot = self._slot_of.get(node_id)
                if slot is not None:
                    mask |= 1 << slot
            if len(self._masks) >= 256:
                self._masks.clear()
            self._masks[key] = mask
        return mask

    @staticmethod
    def _fresh_prefix(hashes: Sequence[int], lru: OrderedDict[int, float], cutoff: float, below: int) -> int:
        """How many leading chunks (at most ``below``) ``lru`` holds sent at or after ``cutoff``."""
        low, high = 0, below  # answer in [low, high]
        while low < high:
            mid = (low + high + 1) >> 1
            if lru.get(hashes[mid - 1], -math.inf) >= cutoff:
                low = mid
            else:
                high = mid - 1
        return low

    def insert_hashes(self, node_id: int, hashes: Sequence[int], now_s: float) -> None:
        """Record that the prefix named by ``hashes`` was sent to ``node_id`` at ``now_s``."""
        if not hashes:
            return
        self._touch(node_id, hashes, now_s)
        self._outbox.append((node_id, tuple(hashes), now_s))

    def apply_remote(self, update: PrefixUpdate) -> None:
        """Apply another gateway's insertion (not queued for sharing again)."""
        if update.chunk_hashes:
            self._touch(update.node_id, update.chunk_hashes, update.ts)

    def _touch(self, node_id: int, hashes: Sequence[int], ts: float) -> None:
        lru = self._lru.get(node_id)
        if lru is None:
            lru = self._add_node(node_id)
        bit = 1 << self._slot_of[node_id]
        holders = self._holders
        move_to_end = lru.move_to_end
        # Tail first, so the shared prefix ends up the most recently used.
        for chunk in reversed(hashes):
            sent_s = lru.get(chunk)
            if sent_s is None:
                lru[chunk] = ts
                holders[chunk] = holders.get(chunk, 0) | bit
            else:
                move_to_end(chunk)
                if ts > sent_s:
                    lru[chunk] = ts
        self._evict(lru, bit, self._capacity_chunks[node_id], ts - self.ttl_s)

    def _add_node(self, node_id: int) -> OrderedDict[int, float]:
        lru = self._lru[node_id] = OrderedDict()
        slot = self._free_slots.pop() if self._free_slots else len(self._slot_of)
        self._slot_of[node_id] = slot
        self._node_in_slot[slot] = node_id
        self._masks.clear()  # cached candidate masks may name this node
        self._set_capacity(node_id, self._kv_tokens.get(node_id, self.default_capacity_tokens))
        return lru

    def _evict(self, lru: OrderedDict[int, float], bit: int, capacity: int, cutoff: float) -> None:
        holders = self._holders
        popitem = lru.popitem
        while len(lru) > capacity:
            self._drop(popitem(last=False)[0], bit, holders)
        # Expired entries sit at the old end; dropping them keeps stale matches rare.
        while lru:
            oldest = next(iter(lru))
            if lru[oldest] >= cutoff:
                break
            del lru[oldest]
            self._drop(oldest, bit, holders)

    @staticmethod
    def _drop(chunk: int, bit: int, holders: dict[int, int]) -> None:
        mask = holders[chunk] & ~bit
        if mask:
            holders[chunk] = mask
        else:
            del holders[chunk]

    # ---- trust (miss-snowball guard) ------------------------------------------------------------

    def trust(self, node_id: int, now_s: float) -> float:
        """How much of this node's predicted cache hits to believe, 0..1 (1: no evidence against)."""
        entry = self._trust.get(node_id)
        if entry is None:
            return 1.0
        value, at_s = entry
        age_s = now_s - at_s
        if age_s <= 0:
            return value
        return 1.0 - (1.0 - value) * 0.5 ** (age_s / TRUST_HALF_LIFE_S)

    def observe(
        self, node_id: int, predicted_fraction: float, observed_fraction: float, now_s: float
    ) -> None:
        """Feed back what the node really had cached for a request routed to it.

        ``predicted_fraction``: the index's matched tokens / estimated prompt tokens at decision time.
        ``observed_fraction``: the node's ``usage.prompt_tokens_details.cached_tokens`` /
        ``usage.prompt_tokens``. Fractions, so tokenizer differences cancel out. No prediction, no
        evidence: observations with ``predicted_fraction`` 0 are ignored.
        """
        if predicted_fraction <= 0:
            return
        ratio = min(1.0, max(0.0, observed_fraction / predicted_fraction))
        current = self.trust(node_id, now_s)
        self._trust[node_id] = ((1.0 - TRUST_ALPHA) * current + TRUST_ALPHA * ratio, now_s)

    # ---- fleet changes --------------------------------------------------------------------------

    def sync_nodes(self, nodes: Iterable[NodeSpec]) -> None:
        """Size every node to its KV capacity and forget nodes that left the fleet."""
        known: set[int] = set()
        for node in nodes:
            known.add(node.id)
            self.set_capacity(node.id, node.kv_capacity_tokens)
        for node_id in list(self._lru.keys() | self._kv_tokens.keys()):
            if node_id not in known:
                self.forget_node(node_id)

    def set_capacity(self, node_id: int, kv_capacity_tokens: int) -> None:
        """Resize one node's share of the index (evicting its least recently sent chunks)."""
        self._kv_tokens[node_id] = kv_capacity_tokens
        self._set_capacity(node_id, kv_capacity_tokens)

    def _set_capacity(self, node_id: int, kv_capacity_tokens: int) -> None:
        capacity = max(1, int(kv_capacity_tokens / self._chunk_tokens))
        self._capacity_chunks[node_id] = capacity
        lru = self._lru.get(node_id)
        if lru is not None and len(lru) > capacity:
            self._evict(lru, 1 << self._slot_of[node_id], capacity, -math.inf)

    def set_chars_per_token(self, chars_per_token: float) -> None:
        """Change the chars -> tokens ratio (a policy change); re-sizes every node."""
        if not chars_per_token > 0:
            raise ValueError(f"chars_per_token must be positive, got {chars_per_token!r}")
        self._chunk_tokens = CHUNK_BYTES / chars_per_token
        for node_id in list(self._capacity_chunks):
            self._set_capacity(node_id, self._kv_tokens.get(node_id, self.default_capacity_tokens))

    def forget_node(self, node_id: int) -> None:
        """Drop everything known about a node (it left the fleet)."""
        lru = self._lru.pop(node_id, None)
        if lru is not None:
            slot = self._slot_of.pop(node_id)
            del self._node_in_slot[slot]
            self._free_slots.append(slot)
            self._masks.clear()
            bit = 1 << slot
            holders = self._holders
            for chunk in lru:
                self._drop(chunk, bit, holders)
        self._kv_tokens.pop(node_id, None)
        self._capacity_chunks.pop(node_id, None)
        self._trust.pop(node_id, None)

    # ---- sharing and introspection --------------------------------------------------------------

    def take_updates(self) -> list[tuple[int, tuple[int, ...], float]]:
        """This gateway's insertions since the last call: (node id, chunk hashes, unix s)."""
        updates = list(self._outbox)
        self._outbox.clear()
        return updates

    def chunks_held(self, node_id: int) -> int:
        """How many chunks the index currently attributes to a node."""
        lru = self._lru.get(node_id)
        return len(lru) if lru is not None else 0

    def capacity_chunks(self, node_id: int) -> int:
        """The most chunks the index keeps for a node."""
        return self._capacity_chunks.get(
            node_id, max(1, int(self.default_capacity_tokens / self._chunk_tokens))
        )
