"""The gateway's prefix index: precise where a node publishes KV events, approximate elsewhere.

One object behind the gateway's ``PrefixIndex`` hook, per node:

- **precise** (the node's subscriber is connected, in sequence and fresh, and the request's model
  has a tokenizer): the prompt's token ids are cut into blocks of the node's block size, keyed by
  content (``routing.precise_index.block_keys``) and matched against the blocks the node reported
  (``PreciseIndex``), capped as vLLM caps a hit (all tokens but the last). Plus what this gateway
  sent there in the last ``PENDING_S`` seconds whose events cannot have arrived yet (the node is
  still prefilling it), so a burst sharing a new prefix is not spread over every node.
- **approximate** otherwise: the text-chunk index (``ApproxPrefixIndex``), fed with every decision
  for every node, so a node falling back finds it warm.

``last_prediction`` holds the chosen node's predicted cached tokens and mode of the decision just
made, which the proxy compares with the node's ``usage.prompt_tokens_details.cached_tokens``
(``record_outcome``) for the predicted-vs-actual metrics.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence

from routing.contract import NodeSpec
from routing.kv_events import KVEvents, Mode
from routing.precise_index import block_keys
from routing.prefix_index import ApproxPrefixIndex

PENDING_S = 5.0
PENDING_MAX_PER_NODE = 256  # prompts remembered per node while their events are on the way


class KVAwareIndex:
    """Per node: precise (KV events) or approximate (text chunks), behind one interface."""

    def __init__(
        self, approx: ApproxPrefixIndex, events: KVEvents, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.approx = approx
        self.events = events
        self._clock = clock
        # node -> (last key of a prompt sent there -> expiry); keys chain, so the last names it all
        self._pending: dict[int, OrderedDict[int, tuple[float, tuple[int, ...]]]] = defaultdict(OrderedDict)
        self._last_keys: dict[int, list[int]] = {}  # block size -> keys of the current prompt
        self._last_modes: dict[int, Mode] = {}
        self._last_matched: dict[int, int] = {}
        self.last_prediction: tuple[int, Mode, int] | None = None  # node, mode, predicted tokens
        # node -> mode -> [predicted tokens, actual tokens]
        self.cached_tokens: dict[tuple[int, Mode], list[int]] = defaultdict(lambda: [0, 0])

    def mode(self, node_id: int) -> Mode:
        return self.events.mode(node_id)

    def wants_prompt_ids(self, candidates: Iterable[NodeSpec]) -> bool:
        """True when some candidate is matched precisely (so the prompt is worth tokenizing)."""
        now = self._clock()
        subscribers = self.events.subscribers
        return any(
            node.id in subscribers and subscribers[node.id].mode(now) == "precise" for node in candidates
        )

    # ---- the gateway's hook -------------------------------------------------------------------

    def match(
        self, node_ids: Sequence[int], prompt_text: str, prompt_ids: array | None = None
    ) -> dict[int, int]:
        now = self._clock()
        events = self.events
        modes: dict[int, Mode] = {}
        approx_nodes: list[int] = []
        precise_nodes: list[int] = []
        for node_id in node_ids:
            mode: Mode = events.mode(node_id, now) if prompt_ids is not None else "approximate"
            modes[node_id] = mode
            (precise_nodes if mode == "precise" else approx_nodes).append(node_id)
        self._last_modes = modes
        self._last_keys = {}
        result = self.approx.match(tuple(approx_nodes), prompt_text) if approx_nodes else {}
        if precise_nodes and prompt_ids is not None:
            index = events.index
            by_size: dict[int, list[int]] = defaultdict(list)
            for node_id in precise_nodes:
                by_size[index.block_size(node_id) or 16].append(node_id)
            for block_size, nodes in by_size.items():
                keys = block_keys(prompt_ids, block_size, (len(prompt_ids) - 1) // block_size)
                self._last_keys[block_size] = keys
                matched = index.match_keys(keys, nodes, block_size)
                trust = self.approx.trust
                for node_id in nodes:
                    pending = self._pending_match(node_id, keys, now) * block_size
                    tokens = max(matched.get(node_id, 0), pending)
                    if tokens:
                        # Exact when decided; a node that thrashes may evict it before the
                        # request is admitted (its queue), which the trust feedback measures.
                        result[node_id] = int(tokens * trust(node_id, now))
        self._last_matched = result
        return result

    def insert(self, node_id: int, prompt_text: str) -> None:
        self.approx.insert(node_id, prompt_text)
        mode = self._last_modes.get(node_id, "approximate")
        self.last_prediction = (node_id, mode, self._last_matched.get(node_id, 0))
        if mode != "precise":
            return
        keys = self._last_keys.get(self.events.index.block_size(node_id) or 16)
        if keys:
            pending = self._pending[node_id]
            pending[keys[-1]] = (self._clock() + PENDING_S, tuple(keys))
            pending.move_to_end(keys[-1])
            while len(pending) > PENDING_MAX_PER_NODE:
                pending.popitem(last=False)

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
        for _expiry, sent in pending.values():
            limit = min(len(sent), len(keys))
            if limit <= best or sent[0] != keys[0]:
                continue
            common = 0
            while common < limit and sent[common] == keys[common]:
                common += 1
            best = max(best, common)
        return best

    def observe(
        self, node_id: int, predicted_fraction: float, observed_fraction: float, now_s: float
    ) -> None:
        # One trust per node, whichever index predicted: a precise prediction is exact when made,
        # but a node whose queue evicts before admission still falls short (miss-snowball guard).
        self.approx.observe(node_id, predicted_fraction, observed_fraction, now_s)

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
