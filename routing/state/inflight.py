"""This gateway's own bookkeeping of the nodes: outstanding work, and nodes that just failed.

Outstanding work per node feeds ``least_load`` and the queue terms of cost-based algorithms. A
request counts toward its node's outstanding prefill tokens until the first byte comes back (the
node has finished prefill by then), toward outstanding requests and context tokens (the KV cache
its prompt holds while it decodes) until it is done; toward the
node's home requests too when its client is in the node's region (the gateway's region, or the
``client_region`` given), once ``set_node_regions`` said where the nodes are.
(Nodes that fail are kept out by ``routing.resilience.breaker``.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from routing.algorithms.base import NodeLoad


class _NodeCounts:
    """One node's outstanding work from this gateway: what ``_add`` moves, four plain fields (one
    dict lookup a request to find them, none for a lease, which keeps them)."""

    __slots__ = ("context_tokens", "home_requests", "prefill_tokens", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.prefill_tokens = 0
        self.home_requests = 0
        self.context_tokens = 0


class Lease:
    """One request's claim on a node; ``first_byte`` and ``release`` are idempotent."""

    __slots__ = ("_book", "_counts", "_home", "_open", "_prefill_open", "node_id", "prefill_tokens")

    def __init__(
        self, book: InFlight, node_id: int, prefill_tokens: int, home: int, counts: _NodeCounts
    ) -> None:
        self._book = book
        self._counts = counts
        self.node_id = node_id
        self.prefill_tokens = prefill_tokens
        self._home = home  # 1 when the client is in the node's region
        self._prefill_open = True
        self._open = True

    def first_byte(self) -> None:
        if self._prefill_open:
            self._prefill_open = False
            self._book._add(self._counts, self.node_id, 0, -self.prefill_tokens, 0, 0)

    def release(self) -> None:
        if self._open:
            self._open = False
            prefill = -self.prefill_tokens if self._prefill_open else 0
            self._prefill_open = False
            self._book._add(self._counts, self.node_id, -1, prefill, -self._home, -self.prefill_tokens)


class InFlight:
    """Outstanding requests and prefill tokens per node id, plus peers' load."""

    __slots__ = (
        "_changed",
        "_counts",
        "_homes",
        "_loads",
        "_node_regions",
        "_peer_load",
        "_view",
        "_view_stale",
        "on_release",
        "region",
    )

    def __init__(self, region: str = "") -> None:
        self.region = region  # the gateway's: where its clients are
        # Per node that ever had work here, its counts (one object per node instead of four dicts
        # of ints: ~5 k instructions a request less, compiled); ``_homes`` the nodes that ever had
        # a home request, in the order they first had one (``home_requests()``'s keys).
        self._counts: dict[int, _NodeCounts] = {}
        self._homes: dict[int, _NodeCounts] = {}
        self._node_regions: Mapping[int, str] = {}
        self._peer_load: dict[int, NodeLoad] = {}
        self.on_release: Callable[[int], None] | None = None  # a request on the node finished
        # ``load_view``'s pieces, kept between calls: a frozen ``NodeLoad`` costs ~0.7 µs to build
        # (compiled too), and between two requests' views only the nodes in ``_changed`` moved.
        self._loads: dict[int, NodeLoad] = {}  # ours, nodes with work only
        self._changed: set[int] = set()
        # With peers: ours plus theirs per node, kept up to date node by node (only the nodes whose
        # own counts moved are summed again; all of them when the peers' loads are swapped).
        self._view: dict[int, NodeLoad] = {}
        self._view_stale = True

    def set_node_regions(self, node_regions: Mapping[int, str]) -> None:
        """Node id -> region, from the current snapshot (requests already begun keep their count)."""
        self._node_regions = node_regions

    def begin(self, node_id: int, prefill_tokens: int, client_region: str | None = None) -> Lease:
        """A request leaves for ``node_id``; its client is in ``client_region`` (the gateway's if None)."""
        node_region = self._node_regions.get(node_id)
        home = int(node_region is not None and node_region == (client_region or self.region))
        counts = self._counts.get(node_id)
        if counts is None:
            counts = self._counts[node_id] = _NodeCounts()
        self._add(counts, node_id, 1, prefill_tokens, home, prefill_tokens)
        return Lease(self, node_id, prefill_tokens, home, counts)

    def _add(
        self,
        counts: _NodeCounts,
        node_id: int,
        requests: int,
        prefill_tokens: int,
        home_requests: int,
        context_tokens: int,
    ) -> None:
        counts.requests += requests
        counts.prefill_tokens += prefill_tokens
        counts.context_tokens += context_tokens
        if home_requests:
            counts.home_requests += home_requests
            if node_id not in self._homes:
                self._homes[node_id] = counts
        self._changed.add(node_id)
        if requests < 0 and self.on_release is not None:
            self.on_release(node_id)

    def outstanding(self, node_id: int) -> int:
        """Outstanding requests on ``node_id``: ours plus the peers'."""
        peer = self._peer_load.get(node_id)
        counts = self._counts.get(node_id)
        return (counts.requests if counts is not None else 0) + (
            peer.outstanding_requests if peer is not None else 0
        )

    def outstanding_requests(self) -> dict[int, int]:
        return {node_id: counts.requests for node_id, counts in self._counts.items()}

    def outstanding_prefill_tokens(self) -> dict[int, int]:
        return {node_id: counts.prefill_tokens for node_id, counts in self._counts.items()}

    def home_requests(self) -> dict[int, int]:
        return {node_id: counts.home_requests for node_id, counts in self._homes.items()}

    def outstanding_context_tokens(self) -> dict[int, int]:
        return {node_id: counts.context_tokens for node_id, counts in self._counts.items()}

    def set_peer_load(self, load: Mapping[int, NodeLoad]) -> None:
        """Other gateways' outstanding work (from the shared gateway-load hash), added to ours.

        Copied into a dict (the sharing loop hands a read-only proxy): compiled, a dict is read
        with dict operations, a proxy through Python's generic mapping calls, once per request.
        """
        self._peer_load = dict(load)
        self._view_stale = True

    def load_view(self) -> dict[int, NodeLoad]:
        """A fresh node id -> ``NodeLoad`` map (ours plus peers'), safe to hand to an algorithm.

        Built per request, so it rebuilds only what moved: our ``NodeLoad`` of the nodes whose
        counts changed since the last view and, with peers, those nodes' sums with the peers' load
        (every node's when the peers' loads were swapped, every ``load_interval_s``); the view is
        then one dict copy.
        """
        loads = self._loads
        changed = self._changed
        peers = self._peer_load
        view = self._view
        summing = bool(peers) and not self._view_stale
        if changed:
            all_counts = self._counts
            for node_id in changed:
                counts = all_counts[node_id]  # a node in ``_changed`` has its counts
                node_requests = counts.requests
                node_prefill = counts.prefill_tokens
                own: NodeLoad | None = None
                if node_requests or node_prefill:
                    own = NodeLoad(node_requests, node_prefill, counts.home_requests, counts.context_tokens)
                    loads[node_id] = own
                else:
                    loads.pop(node_id, None)
                if summing:
                    _put_sum(view, node_id, own, peers.get(node_id))
            changed.clear()
        if not peers:
            self._view_stale = True  # peers come back: sum every node then
            return dict(loads)
        if self._view_stale:
            self._view_stale = False
            view.clear()
            for node_id, own_load in loads.items():
                _put_sum(view, node_id, own_load, peers.get(node_id))
            for node_id, peer in peers.items():
                if node_id not in view:
                    view[node_id] = peer
        return dict(view)


def _put_sum(view: dict[int, NodeLoad], node_id: int, own: NodeLoad | None, peer: NodeLoad | None) -> None:
    """``view[node_id]``: ours plus the peers' load there (either may be missing)."""
    if own is None:
        if peer is None:
            view.pop(node_id, None)
        else:
            view[node_id] = peer
    elif peer is None:
        view[node_id] = own
    else:
        view[node_id] = NodeLoad(
            own.outstanding_requests + peer.outstanding_requests,
            own.outstanding_prefill_tokens + peer.outstanding_prefill_tokens,
            own.home_requests + peer.home_requests,
            own.outstanding_context_tokens + peer.outstanding_context_tokens,
        )
