"""The gateway's prefix index: precise where a node publishes KV events, approximate elsewhere.

One object behind the gateway's ``PrefixIndex`` hook, per node:

- **precise** (the node's subscriber is connected, in sequence and fresh, and the request's model
  has a tokenizer): the prompt's token ids are cut into blocks of the node's block size, keyed by
  content (``routing.cache.precise_index.block_keys``) and matched against the blocks the node reported
  (``PreciseIndex``), capped as vLLM caps a hit (all tokens but the last). Plus what this gateway
  sent there in the last ``PENDING_S`` seconds whose events cannot have arrived yet (the node is
  still prefilling it), so a burst sharing a new prefix is not spread over every node.
- **approximate** otherwise: the text-chunk index (``ApproxPrefixIndex``), fed with every decision
  for every node, so a node falling back finds it warm.

``last_prediction`` holds the chosen node's predicted cached tokens and mode of the decision just
made (``insert``); the proxy puts it on that request's ``Decision`` at once and compares it with
the node's ``usage.prompt_tokens_details.cached_tokens`` (``record_outcome``) for the
predicted-vs-actual metrics.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Final

from xxhash import xxh3_64_intdigest

from routing.cache.approx_index import ApproxPrefixIndex
from routing.cache.kv_events.manager import KVEvents
from routing.cache.kv_events.subscriber import Mode
from routing.cache.precise_index import Tenant, block_keys, extend_block_keys
from routing.contract import NodeSpec

PENDING_S: Final = 2.0
PENDING_MAX_PER_NODE: Final = 256  # prompts remembered per node while their events are on the way
# Block keys of recent prompts, found again by a digest of their first ANCHOR_BLOCKS * k blocks:
# a new turn repeats its system prompt and history, so only its new blocks are keyed (~5 us a
# 64-block probe instead of ~0.2 us per block for all of them).
ANCHOR_BLOCKS: Final = 64
KEY_CACHE_PROMPTS: Final = 256


class KVAwareIndex:
    """Per node: precise (KV events) or approximate (text chunks), behind one interface."""

    def __init__(
        self, approx: ApproxPrefixIndex, events: KVEvents, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.approx = approx
        self.events = events
        self._clock = clock
        # node -> (last key of a prompt sent there -> expiry); keys chain, so the last names it all
        # node -> (last key of a prompt sent there -> (expiry, its keys, first block it did not hold))
        self._pending: dict[int, OrderedDict[int, tuple[float, tuple[int, ...], int]]] = defaultdict(
            OrderedDict
        )
        self._last_held: dict[int, int] = {}  # node -> blocks the events showed held (last match)
        # node -> (expiry, text chunk hashes) of prompts sent there before their tokens were known
        # (a long new segment is tokenized after the decision): in flight all the same.
        self._text_pending: dict[int, deque[tuple[float, tuple[int, ...]]]] = defaultdict(
            lambda: deque(maxlen=PENDING_MAX_PER_NODE)
        )
        self._last_keys: dict[int, list[int]] = {}  # block size -> keys of the current prompt
        self._last_modes: dict[int, Mode] = {}
        self._last_matched: dict[int, int] = {}  # precise node -> the index's prediction, before trust
        self._last_approx: dict[int, int] = {}  # approximate node -> its match, after trust
        self._last_now = 0.0  # the clock of the last match (the trust it was discounted by)
        self.last_prediction: tuple[int, Mode, int] | None = None  # node, mode, predicted tokens
        self._block_sizes: dict[int, int] = {}  # node -> its model's kv_block_size (the snapshot)
        self._key_cache: OrderedDict[tuple[int, int, int, Tenant | None], list[int]] = OrderedDict()
        # node -> mode -> [predicted tokens, actual tokens]
        self.cached_tokens: dict[tuple[int, Mode], list[int]] = defaultdict(lambda: [0, 0])

    def mode(self, node_id: int) -> Mode:
        return self.events.mode(node_id)

    def wants_prompt_ids(self, candidates: Iterable[NodeSpec]) -> bool:
        """True when some candidate is matched precisely (so the prompt is worth tokenizing)."""
        subscribers = self.events.subscribers
        if not subscribers:  # no node publishes KV events: per request, without a clock read
            return False
        now = self._clock()
        return any(
            node.id in subscribers and subscribers[node.id].mode(now) == "precise" for node in candidates
        )

    # ---- the gateway's hook -------------------------------------------------------------------

    def match(
        self,
        node_ids: Sequence[int],
        prompt_text: str,
        prompt_ids: array | None = None,
        tenant: Tenant | None = None,
    ) -> dict[int, int]:
        self._last_keys = {}
        self._last_matched = {}
        if prompt_ids is None:
            # No token ids: every node is matched approximately (insert's default mode), and
            # the prediction before trust is worked out for the chosen node only (insert), from
            # the time of this match (read only when there is a match to discount).
            self._last_modes = {}
            result = self.approx.match(node_ids, prompt_text) if node_ids else {}
            self._last_approx = result
            if result:
                self._last_now = self._clock()
            return result
        now = self._clock()
        events = self.events
        self._last_now = now
        modes: dict[int, Mode] = {}
        approx_nodes: list[int] = []
        precise_nodes: list[int] = []
        for node_id in node_ids:
            mode: Mode = events.mode(node_id, now)
            modes[node_id] = mode
            (precise_nodes if mode == "precise" else approx_nodes).append(node_id)
        self._last_modes = modes
        result = self.approx.match(tuple(approx_nodes), prompt_text) if approx_nodes else {}
        self._last_approx = result
        trust = self.approx.trust
        # What each index says the node holds, before the trust discount (the prediction the
        # request record and the metrics compare with the node's cached tokens): for the
        # approximate nodes worked out by insert, for the chosen node only.
        raw = self._last_matched
        if precise_nodes and prompt_ids is not None:
            index = events.index
            text_hashes: list[int] | None = None
            if any(self._text_pending.get(node_id) for node_id in precise_nodes):
                text_hashes = self.approx.text_hashes(prompt_text)
            by_size: dict[int, list[int]] = defaultdict(list)
            for node_id in precise_nodes:
                by_size[self.block_size(node_id)].append(node_id)
            for block_size, nodes in by_size.items():
                keys = self._keys_for(prompt_ids, block_size, (len(prompt_ids) - 1) // block_size, tenant)
                self._last_keys[block_size] = keys
                matched = index.match_keys(keys, nodes, block_size)
                for node_id in nodes:
                    self._last_held[node_id] = matched.get(node_id, 0) // block_size
                    pending = self._pending_match(node_id, keys, now) * block_size
                    if (
                        text_hashes is not None
                        and not matched.get(node_id)
                        and self._text_pending.get(node_id)
                    ):
                        # Only until the node's events show any of it: then they speak for it.
                        chunks = self._text_pending_match(node_id, text_hashes, now)
                        pending = max(
                            pending, min(len(prompt_ids) - 1, int(chunks * self.approx.chunk_tokens))
                        )
                    tokens = max(matched.get(node_id, 0), pending)
                    if tokens:
                        raw[node_id] = tokens
                        # Exact when decided; a node that thrashes may evict it before the
                        # request is admitted (its queue), which the trust feedback measures.
                        result[node_id] = int(tokens * trust(node_id, now))
        return result

    def set_block_sizes(self, block_sizes: dict[int, int]) -> None:
        """Node id -> its model's ``kv_block_size`` from the snapshot (until its events say)."""
        self._block_sizes = dict(block_sizes)

    def block_size(self, node_id: int) -> int:
        """The node's block size: as its events report it, else its model's, else vLLM's GPU 16."""
        return self.events.index.block_size(node_id) or self._block_sizes.get(node_id) or 16

    def _keys_for(
        self, prompt_ids: array, block_size: int, num_blocks: int, tenant: Tenant | None = None
    ) -> list[int]:
        """The prompt's block keys, reusing those of an earlier prompt with the same beginning
        (and the same tenant: another salt or adapter keys the same ids apart)."""
        if num_blocks < ANCHOR_BLOCKS:
            return block_keys(prompt_ids, block_size, num_blocks, tenant)
        data = memoryview(prompt_ids).cast("B")
        anchor_bytes = ANCHOR_BLOCKS * block_size * 4
        cache = self._key_cache
        anchors = num_blocks // ANCHOR_BLOCKS
        known: list[int] = []
        for anchor in range(anchors, 0, -1):
            digest = xxh3_64_intdigest(data[: anchor * anchor_bytes])
            cached = cache.get((block_size, anchor, digest, tenant))
            if cached is not None:
                cache.move_to_end((block_size, anchor, digest, tenant))
                known = cached[: anchor * ANCHOR_BLOCKS]
                break
        keys = known[:]
        extend_block_keys(keys, prompt_ids, block_size, num_blocks, tenant)
        for anchor in range(len(known) // ANCHOR_BLOCKS + 1, anchors + 1):
            digest = xxh3_64_intdigest(data[: anchor * anchor_bytes])
            cache[(block_size, anchor, digest, tenant)] = keys
        while len(cache) > KEY_CACHE_PROMPTS * 4:
            cache.popitem(last=False)
        return keys

    def text_hashes(self, prompt_text: str) -> list[int]:
        return self.approx.text_hashes(prompt_text)

    def insert(self, node_id: int, prompt_text: str) -> None:
        self.approx.insert(node_id, prompt_text)
        mode = self._last_modes.get(node_id, "approximate")
        predicted = self._last_matched.get(node_id)
        if predicted is None:
            tokens = self._last_approx.get(node_id, 0)
            trust = self.approx.trust(node_id, self._last_now) if tokens else 1.0
            predicted = int(tokens / max(trust, 1e-3)) if tokens else 0
        self.last_prediction = (node_id, mode, predicted)
        if mode != "precise":
            # Only a node with a subscriber can be precise: the others (every node, in a fleet that
            # publishes no KV events) cost no clock read and no call per request.
            if node_id not in self.events.subscribers:
                return
            now = self._clock()
            if self.events.mode(node_id, now) == "precise":
                # A precise node routed on estimates (the prompt's tokens were not known yet).
                self._text_pending[node_id].append(
                    (now + PENDING_S, tuple(self.approx.text_hashes(prompt_text)))
                )
            return
        keys = self._last_keys.get(self.block_size(node_id))
        held = self._last_held.get(node_id, 0)
        if keys and held < len(keys):
            pending = self._pending[node_id]
            pending[keys[-1]] = (self._clock() + PENDING_S, tuple(keys), held)
            pending.move_to_end(keys[-1])
            while len(pending) > PENDING_MAX_PER_NODE:
                pending.popitem(last=False)

    def _text_pending_match(self, node_id: int, hashes: list[int], now: float) -> int:
        """Chunks of this prompt's text shared with one sent to the node in the last PENDING_S."""
        entries = self._text_pending[node_id]
        while entries and entries[0][0] <= now:
            entries.popleft()
        best = 0
        for _expiry, sent in entries:
            limit = min(len(sent), len(hashes))
            common = 0
            while common < limit and sent[common] == hashes[common]:
                common += 1
            best = max(best, common)
        return best

    def _pending_match(self, node_id: int, keys: list[int], now: float) -> int:
        pending = self._pending.get(node_id)
        if not pending or not keys:
            return 0
        while pending:  # expire from the oldest end
            oldest = next(iter(pending.values()))
            if oldest[0] > now:
                break
            pending.popitem(last=False)
        best = 0
        holds = self.events.index.holds
        confirmed = []
        for last_key, (_expiry, sent, first_new) in pending.items():
            if holds(node_id, sent[first_new]):
                # The node is computing it: from now on its events say what it holds (and evicts).
                confirmed.append(last_key)
                continue
            limit = min(len(sent), len(keys))
            if limit <= best or sent[0] != keys[0]:
                continue
            common = 0
            while common < limit and sent[common] == keys[common]:
                common += 1
            best = max(best, common)
        for last_key in confirmed:
            del pending[last_key]
        return best

    def observe(
        self, node_id: int, predicted_fraction: float, observed_fraction: float, now_s: float
    ) -> None:
        # One trust per node, whichever index predicted: a precise prediction is exact when made,
        # but a node whose queue evicts before admission still falls short (miss-snowball guard).
        self.approx.observe(node_id, predicted_fraction, observed_fraction, now_s)

    def note_served(self, node_id: int, prompt_tokens: int | None, predicted_cached_tokens: int = 0) -> None:
        """The node answered a request: when the prompt had a full block the index did not show
        the node holding, vLLM cached it and its event is due (a node that sends none is flagged).
        A short or fully cached prompt stores no block, and is no sign either way. A node
        without a subscriber has no events to wait for: nothing to work out (every request,
        in a fleet that publishes no KV events)."""
        if node_id not in self.events.subscribers:
            return
        block_size = self.block_size(node_id)
        if (
            prompt_tokens is None
            or (prompt_tokens - 1) // block_size <= predicted_cached_tokens // block_size
        ):
            return
        self.events.note_served(node_id)

    def record_outcome(self, node_id: int, mode: Mode, predicted_tokens: int, actual_tokens: int) -> None:
        totals = self.cached_tokens[(node_id, mode)]
        totals[0] += predicted_tokens
        totals[1] += actual_tokens

    def cached_token_totals(self) -> Iterable[tuple[int, str, int, int]]:
        for (node_id, mode), (predicted, actual) in sorted(self.cached_tokens.items()):
            yield node_id, mode, predicted, actual

    def sync_nodes(self, nodes: Iterable[NodeSpec]) -> None:
        nodes = list(nodes)
        self.approx.sync_nodes(nodes)
        known = {node.id for node in nodes}
        for node_id in list(self._pending):
            if node_id not in known:
                del self._pending[node_id]

    def set_chars_per_token(self, chars_per_token: float) -> None:
        self.approx.set_chars_per_token(chars_per_token)
