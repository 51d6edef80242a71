"""What each node holds in its KV cache, known precisely from vLLM's KV events, keyed by content.

vLLM names a block by a hash of its own (its hash function and seed are engine settings the router
does not share), so the router does not compute vLLM's hashes for a prompt. Instead (llm-d's answer) every ``BlockStored`` carries its blocks'
``token_ids``: the index computes its own **content key** per block, chained like vLLM's hash
(``key_i = xxh3_64(token ids of block i, seed=key_{i-1})``, root 0), and keeps per node a map
engine hash -> content key, so a later ``BlockRemoved`` (which carries engine hashes only) finds
what to drop (vLLM caches a block computed twice at once twice, under one hash, and removes each
copy on its own: copies are counted). The gateway computes the same content keys from the prompt's token ids
(``block_keys``) and walks them: the match is the longest run of leading blocks a node holds.

Which nodes hold a key is one integer bitmask per key (a bit per node slot), as in the approximate
index, so a match is one dict lookup and one AND per block, whatever the number of nodes.

**Tenants.** vLLM hashes more than the tokens: a request's ``cache_salt`` on its first block, a
LoRA adapter's name on every block (0.32's ``BlockStored.extra_keys``, one entry per block, and
``lora_name``). Two tenants never share blocks in vLLM, so they must not in the index: a block's
``extra_keys`` entry is folded into its key's seed (``xxh3_64(msgpack(extra), seed=parent)``), and
the gateway folds in the same ``Tenant`` extras for a request (``Tenant.block_extra``). Without
extras the key is as before.

Blocks whose parent is unknown to the index (stored before the subscription began and not
replayed) cannot be keyed: they are counted as dropped (``unknown_parent``). Such gaps only ever
make the index under-estimate a node's cache, never claim blocks it does not hold.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

_hash = xxhash.xxh3_64_intdigest
ROOT_KEY = 0

EngineHash = int | bytes | tuple[str, int | bytes]


@dataclass(frozen=True, slots=True)
class Tenant:
    """What vLLM hashes into a request's blocks beyond its tokens (vLLM's extra keys)."""

    lora_name: str | None = None  # the request's LoRA adapter (its ``model``), None: the base model
    cache_salt: str | None = None  # the request's ``cache_salt``

    def block_extra(self, block_index: int) -> list[Any] | None:
        """The block's ``extra_keys`` entry as vLLM 0.32 sends it: the adapter first, then the salt
        (first block only), None when there is nothing."""
        extra: list[Any] = []
        if self.lora_name is not None:
            extra.append(self.lora_name)
        if self.cache_salt is not None and block_index == 0:
            extra.append(self.cache_salt)
        return extra or None


def _seed(parent: int, extra: Any) -> int:
    """The seed of a block's key: its parent's key, with the block's extra keys folded in."""
    return parent if extra is None else _hash(_encode_extra(extra), parent)


_encode_extra = msgspec.msgpack.Encoder().encode


def block_keys(
    token_ids: Sequence[int], block_size: int, max_blocks: int | None = None, tenant: Tenant | None = None
) -> list[int]:
    """Content keys of the full blocks of ``token_ids`` (at most ``max_blocks``), first block first."""
    keys: list[int] = []
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    extend_block_keys(keys, token_ids, block_size, num_blocks, tenant)
    return keys


def extend_block_keys(
    keys: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int, tenant: Tenant | None = None
) -> None:
    """Append to ``keys`` (the keys of the first ``len(keys)`` blocks) up to ``num_blocks`` keys."""
    start_block = len(keys)
    if num_blocks <= start_block:
        del keys[num_blocks:]
        return
    data = memoryview(array("I", token_ids[start_block * block_size : num_blocks * block_size]).tobytes())
    step = block_size * 4
    parent = keys[-1] if keys else ROOT_KEY
    append = keys.append
    if tenant is None or (tenant.lora_name is None and tenant.cache_salt is None):
        for start in range(0, (num_blocks - start_block) * step, step):
            parent = _hash(data[start : start + step], parent)
            append(parent)
        return
    block_extra = tenant.block_extra
    for block, start in enumerate(range(0, (num_blocks - start_block) * step, step), start_block):
        parent = _hash(data[start : start + step], _seed(parent, block_extra(block)))
        append(parent)


class _NodeBlocks:
    """One node's blocks: engine hash -> content key, and the node's slot in the masks."""

    __slots__ = ("bit", "block_size", "copies", "keys")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.keys: dict[EngineHash, int] = {}
        # Engine hashes cached more than once -> copies: vLLM does not de-duplicate blocks, and
        # each copy is stored and removed on its own (rare: only these are counted).
        self.copies: dict[EngineHash, int] = {}
        self.block_size = 0


class PreciseIndex:
    """Per-node block sets from KV events; ``match`` answers in tokens."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # content key -> bitmask of node slots
        self._nodes: dict[int, _NodeBlocks] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._key_refs: dict[tuple[int, int], int] = {}  # (slot, key) -> engine blocks with that key

    # ---- event application (the subscriber calls these) -----------------------------------------

    def _node(self, node_id: int) -> _NodeBlocks:
        node = self._nodes.get(node_id)
        if node is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot = self._next_slot
                self._next_slot += 1
            node = self._nodes[node_id] = _NodeBlocks(slot)
        return node

    def store(
        self,
        node_id: int,
        block_hashes: Sequence[EngineHash],
        parent_block_hash: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: Sequence[Any] | None = None,
        lora_name: str | None = None,
    ) -> int:
        """Apply a BlockStored; returns how many blocks could not be keyed (unknown parent).

        ``extra_keys``: one entry per block (vLLM 0.32); without them (older vLLM) a ``lora_name``
        stands for the adapter's entry on every block.
        """
        node = self._node(node_id)
        if parent_block_hash is None:
            parent = ROOT_KEY
        else:
            known = node.keys.get(parent_block_hash)
            if known is None:
                return len(block_hashes)
            parent = known
        if block_size <= 0 or len(token_ids) < len(block_hashes) * block_size:
            return len(block_hashes)
        node.block_size = block_size
        data = memoryview(array("I", token_ids[: len(block_hashes) * block_size]).tobytes())
        step = block_size * 4
        bit_index = node.bit
        bit = 1 << bit_index
        holders = self._holders
        refs = self._key_refs
        keys = node.keys
        copies = node.copies
        if extra_keys is None and lora_name is not None:
            extra_keys = [[lora_name]] * len(block_hashes)
        if extra_keys is not None and len(extra_keys) < len(block_hashes):
            return len(block_hashes)
        for i, engine_hash in enumerate(block_hashes):
            seed = parent if extra_keys is None else _seed(parent, extra_keys[i])
            parent = _hash(data[i * step : (i + 1) * step], seed)
            if engine_hash in keys:
                copies[engine_hash] = copies.get(engine_hash, 1) + 1  # another copy of the block
                continue
            keys[engine_hash] = parent
            ref = (bit_index, parent)
            count = refs.get(ref, 0)
            refs[ref] = count + 1
            if not count:
                holders[parent] = holders.get(parent, 0) | bit
        return 0

    def remove(self, node_id: int, block_hashes: Iterable[EngineHash]) -> int:
        """Apply a BlockRemoved; returns how many hashes were unknown."""
        node = self._nodes.get(node_id)
        if node is None:
            return sum(1 for _ in block_hashes)
        unknown = 0
        keys = node.keys
        copies = node.copies
        for engine_hash in block_hashes:
            count = copies.get(engine_hash)
            if count is not None:  # one copy of several is evicted: the node still holds the block
                if count > 2:
                    copies[engine_hash] = count - 1
                else:
                    del copies[engine_hash]
                continue
            key = keys.pop(engine_hash, None)
            if key is None:
                unknown += 1
                continue
            self._unref(node.bit, key)
        return unknown

    def _unref(self, bit_index: int, key: int) -> None:
        ref = (bit_index, key)
        count = self._key_refs[ref] - 1
        if count:
            self._key_refs[ref] = count
            return
        del self._key_refs[ref]
        mask = self._holders[key] & ~(1 << bit_index)
        if mask:
            self._holders[key] = mask
        else:
            del self._holders[key]

    def clear(self, node_id: int) -> None:
        """Forget every block of a node (AllBlocksCleared, a restart, an unrecoverable gap)."""
        node = self._nodes.get(node_id)
        if node is None:
            return
        for key in node.keys.values():
            self._unref(node.bit, key)
        node.keys.clear()
        node.copies.clear()

    def forget_node(self, node_id: int) -> None:
        self.clear(node_id)
        node = self._nodes.pop(node_id, None)
        if node is not None:
            self._free_slots.append(node.bit)

    # ---- queries (the request path) -------------------------------------------------------------

    def blocks(self, node_id: int) -> int:
        node = self._nodes.get(node_id)
        return len(node.keys) if node is not None else 0

    def block_size(self, node_id: int) -> int:
        node = self._nodes.get(node_id)
        return node.block_size if node is not None else 0

    def holds(self, node_id: int, key: int) -> bool:
        node = self._nodes.get(node_id)
        return node is not None and bool(self._holders.get(key, 0) >> node.bit & 1)

    def match_keys(self, keys: Sequence[int], node_ids: Iterable[int], block_size: int) -> dict[int, int]:
        """Node id -> cached prefix tokens (leading blocks held), for the given nodes that hold any.

        vLLM frees a request's blocks tail first and evicts the least recently freed, so a block is
        evicted after every block that extends it: what a node holds of one prompt is a prefix of
        its blocks, and the longest held prefix is found by bisection (a dict lookup and an AND
        per step for all nodes at once), as in the approximate index.
        """
        nodes = self._nodes
        mask = 0
        slot_node: dict[int, int] = {}
        for node_id in node_ids:
            node = nodes.get(node_id)
            if node is not None and node.keys:
                mask |= 1 << node.bit
                slot_node[node.bit] = node_id
        result: dict[int, int] = {}
        if not mask or not keys:
            return result
        holders = self._holders
        pending = holders.get(keys[0], 0) & mask
        high = len(keys)  # every pending node holds block 0 and none holds block `high`
        while pending:
            low = high - 1
            if not holders.get(keys[low], 0) & pending:
                low, top = 0, low
                while top - low > 1:
                    mid = (low + top) >> 1
                    if holders.get(keys[mid], 0) & pending:
                        low = mid
                    else:
                        top = mid
            found = holders[keys[low]] & pending
            pending ^= found
            while found:
                bit = found & -found
                found ^= bit
                result[slot_node[bit.bit_length() - 1]] = (low + 1) * block_size
            high = low
        return result
