"""vLLM-style paged KV cache with automatic prefix caching, reduced to bookkeeping.

As in vLLM V1's ``KVCacheManager``/``BlockPool``:

- The cache has a fixed number of blocks of ``block_size`` tokens.
- A *full* block is identified by a chained hash: ``hash(parent block hash, the block's token
  ids)``, so equal hashes mean equal prefixes. Partial blocks are never shared.
- A block is referenced by every running request that uses it. Blocks nobody references stay
  cached (a later request can hit them) until their space is needed; then the least recently
  freed one is evicted (LRU). A request's blocks are freed tail first, so a shared prefix is
  evicted after the request-specific suffix.
- KV usage counts referenced blocks only, like ``vllm:kv_cache_usage_perc``.
- Blocks are not de-duplicated (``BlockHashToBlockMap``, its NOTE #1): two requests that compute
  the same block at once each cache their own copy under the one hash, each copy stored and evicted
  (and announced in KV events) on its own; a prefix hit takes the oldest copy, as
  ``get_one_block`` does. (Until issue 24's KV review the second copy stayed private and unannounced.)

One simplification: blocks that never got a hash (a partial block) are reused before any cached
block is evicted; vLLM keeps them in the same LRU queue. That only ever helps the hit rate.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

# A request's block table: the id of each cached block it holds, or None for a private block.
BlockEntry = int | None


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The chained hash of one full block (64-bit; stable across processes)."""
    payload = parent_hash.to_bytes(8, "little") + array("I", token_ids).tobytes()
    return int.from_bytes(blake2b(payload, digest_size=8).digest(), "little")


def extend_block_hashes(
    hashes: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int, root_hash: int = 0
) -> None:
    """Append chained hashes to ``hashes`` until it covers the first ``num_blocks`` full blocks.

    ``root_hash`` is the parent of the first block (vLLM's ``NONE_HASH``: random per engine start).
    """
    parent = hashes[-1] if hashes else root_hash
    for index in range(len(hashes), num_blocks):
        start = index * block_size
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)


class KVBlockPool:
    """The blocks of one engine's KV cache: which are referenced, cached and evictable.

    A cached block has an id of its own (a copy); several copies may share a hash.
    """

    __slots__ = (
        "_by_hash",
        "_evictable",
        "_free_unhashed",
        "_hash_of",
        "_next_id",
        "_refcount",
        "block_size",
        "evicted",
        "num_blocks",
        "num_used",
    )

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_used = 0  # blocks referenced by at least one request
        self._free_unhashed = num_blocks
        self._refcount: dict[int, int] = {}  # every cached block id -> references (0: evictable)
        self._hash_of: dict[int, int] = {}  # cached block id -> its hash
        self._by_hash: dict[int, list[int]] = {}  # hash -> its cached copies' ids, oldest first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, LRU first
        self._next_id = 1
        # Hashes evicted since the engine last looked (for KV events); None: nobody listens.
        self.evicted: list[int] | None = None

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._refcount)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: never-hashed ones plus evictable cached ones."""
        return self._free_unhashed + len(self._evictable)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def copies(self, block_hash: int) -> int:
        """How many cached copies of the block there are."""
        return len(self._by_hash.get(block_hash, ()))

    def match_prefix(self, block_hashes: Sequence[int], max_blocks: int) -> int:
        """How many leading blocks (at most ``max_blocks``) are cached right now."""
        matched = 0
        by_hash = self._by_hash
        for block_hash in block_hashes[:max_blocks]:
            if block_hash not in by_hash:
                break
            matched += 1
        return matched

    def can_allocate(self, num_new: int, touching: Sequence[int] = ()) -> bool:
        """Whether ``num_new`` fresh blocks fit after taking references on cached ``touching``."""
        refcount, by_hash = self._refcount, self._by_hash
        taken_from_free = sum(1 for h in touching if refcount[by_hash[h][0]] == 0)
        return num_new <= self.num_free_blocks - taken_from_free

    def acquire_cached(self, block_hashes: Sequence[int]) -> list[BlockEntry]:
        """Reference cached blocks (a prefix hit: the oldest copy of each); they stop being evictable."""
        refcount, by_hash = self._refcount, self._by_hash
        entries: list[BlockEntry] = []
        for block_hash in block_hashes:
            block_id = by_hash[block_hash][0]
            count = refcount[block_id]
            if count == 0:
                del self._evictable[block_id]
                self.num_used += 1
            refcount[block_id] = count + 1
            entries.append(block_id)
        return entries

    def allocate(self, num_new: int) -> list[BlockEntry] | None:
        """Take ``num_new`` private blocks, evicting LRU cached blocks if needed; None if full."""
        if num_new > self.num_free_blocks:
            return None
        from_free = min(num_new, self._free_unhashed)
        self._free_unhashed -= from_free
        for _ in range(num_new - from_free):
            evicted, _none = self._evictable.popitem(last=False)
            del self._refcount[evicted]
            block_hash = self._hash_of.pop(evicted)
            copies = self._by_hash[block_hash]
            copies.remove(evicted)
            if not copies:
                del self._by_hash[block_hash]
            if self.evicted is not None:
                self.evicted.append(block_hash)
        self.num_used += num_new
        return [None] * num_new

    def publish(self, block_hash: int) -> int:
        """Make a private block that just became full findable under its hash; its id.

        A block another request computed meanwhile is cached again, as a copy of its own (vLLM does
        not de-duplicate): each copy is announced, and evicted, on its own.
        """
        block_id = self._next_id
        self._next_id = block_id + 1
        self._refcount[block_id] = 1
        self._hash_of[block_id] = block_hash
        self._by_hash.setdefault(block_hash, []).append(block_id)
        return block_id

    def release(self, entries: Sequence[BlockEntry]) -> None:
        """Drop a request's references, tail block first so its prefix is evicted last."""
        refcount = self._refcount
        evictable = self._evictable
        for entry in reversed(entries):
            if entry is None:
                self._free_unhashed += 1
                self.num_used -= 1
                continue
            count = refcount[entry] - 1
            refcount[entry] = count
            if count == 0:
                evictable[entry] = None
                self.num_used -= 1

    def reset(self) -> bool:
        """Drop every cached block (vLLM's ``reset_prefix_cache``); refused while blocks are in use."""
        if self.num_used:
            return False
        self._refcount.clear()
        self._hash_of.clear()
        self._by_hash.clear()
        self._evictable.clear()
        self._free_unhashed = self.num_blocks
        return True
