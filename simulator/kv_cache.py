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

One simplification: blocks that never got a hash (a partial block) are reused before any cached
block is evicted; vLLM keeps them in the same LRU queue. That only ever helps the hit rate.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

# A request's block table: the hash of each cached block it holds, or None for a private block.
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
    """The blocks of one engine's KV cache: which are referenced, cached and evictable."""

    __slots__ = (
        "_evictable",
        "_free_unhashed",
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
        self._refcount: dict[int, int] = {}  # every cached block hash -> references (0: evictable)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, LRU first
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
        return block_hash in self._refcount

    def match_prefix(self, block_hashes: Sequence[int], max_blocks: int) -> int:
        """How many leading blocks (at most ``max_blocks``) are cached right now."""
        matched = 0
        refcount = self._refcount
        for block_hash in block_hashes[:max_blocks]:
            if block_hash not in refcount:
                break
            matched += 1
        return matched

    def can_allocate(self, num_new: int, touching: Sequence[int] = ()) -> bool:
        """Whether ``num_new`` fresh blocks fit after taking references on cached ``touching``."""
        taken_from_free = sum(1 for h in touching if self._refcount[h] == 0)
        return num_new <= self.num_free_blocks - taken_from_free

    def acquire_cached(self, block_hashes: Sequence[int]) -> list[BlockEntry]:
        """Reference cached blocks (a prefix hit); they stop being evictable."""
        refcount = self._refcount
        for block_hash in block_hashes:
            count = refcount[block_hash]
            if count == 0:
                del self._evictable[block_hash]
                self.num_used += 1
            refcount[block_hash] = count + 1
        return list(block_hashes)

    def allocate(self, num_new: int) -> list[BlockEntry] | None:
        """Take ``num_new`` private blocks, evicting LRU cached blocks if needed; None if full."""
        if num_new > self.num_free_blocks:
            return None
        from_free = min(num_new, self._free_unhashed)
        self._free_unhashed -= from_free
        for _ in range(num_new - from_free):
            evicted, _none = self._evictable.popitem(last=False)
            del self._refcount[evicted]
            if self.evicted is not None:
                self.evicted.append(evicted)
        self.num_used += num_new
        return [None] * num_new

    def publish(self, block_hash: int) -> bool:
        """Make a private block that just became full findable under its hash.

        Returns False when that hash is already cached (another request computed the same block
        meanwhile): the block then stays private, as vLLM keeps such duplicates uncached.
        """
        if block_hash in self._refcount:
            return False
        self._refcount[block_hash] = 1
        return True

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
        self._evictable.clear()
        self._free_unhashed = self.num_blocks
        return True
