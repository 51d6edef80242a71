"""This gateway's own bookkeeping of the nodes: outstanding work, and nodes that just failed.

Outstanding work per node feeds ``least_load`` and the queue terms of cost-based algorithms. A
request counts toward its node's outstanding prefill tokens until the first byte comes back (the
node has finished prefill by then) and toward outstanding requests until it is done.
(Nodes that fail are kept out by ``routing.resilience.breaker``.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from routing.algorithms.base import NodeLoad


class Lease:
    """One request's claim on a node; ``first_byte`` and ``release`` are idempotent."""

    __slots__ = ("_book", "_open", "_prefill_open", "node_id", "prefill_tokens")

    def __init__(self, book: InFlight, node_id: int, prefill_tokens: int) -> None:
        self._book = book
        self.node_id = node_id
        self.prefill_tokens = prefill_tokens
        self._prefill_open = True
        self._open = True

    def first_byte(self) -> None:
        if self._prefill_open:
            self._prefill_open = False
            self._book._add(self.node_id, 0, -self.prefill_tokens)

    def release(self) -> None:
        if self._open:
            self._open = False
            prefill = -self.prefill_tokens if self._prefill_open else 0
            self._prefill_open = False
            self._book._add(self.node_id, -1, prefill)


class InFlight:
    """Outstanding requests and prefill tokens per node id, plus peers' load."""

    __slots__ = ("_peer_load", "_prefill_tokens", "_requests", "on_release")

    def __init__(self) -> None:
        self._requests: dict[int, int] = {}
        self._prefill_tokens: dict[int, int] = {}
        self._peer_load: Mapping[int, NodeLoad] = {}
        self.on_release: Callable[[int], None] | None = None  # a request on the node finished

    def begin(self, node_id: int, prefill_tokens: int) -> Lease:
        self._add(node_id, 1, prefill_tokens)
        return Lease(self, node_id, prefill_tokens)

    def _add(self, node_id: int, requests: int, prefill_tokens: int) -> None:
        self._requests[node_id] = self._requests.get(node_id, 0) + requests
        self._prefill_tokens[node_id] = self._prefill_tokens.get(node_id, 0) + prefill_tokens
        if requests < 0 and self.on_release is not None:
            self.on_release(node_id)

    def outstanding(self, node_id: int) -> int:
        """Outstanding requests on ``node_id``: ours plus the peers'."""
        peer = self._peer_load.get(node_id)
        return self._requests.get(node_id, 0) + (peer.outstanding_requests if peer is not None else 0)

    def outstanding_requests(self) -> dict[int, int]:
        return dict(self._requests)

    def outstanding_prefill_tokens(self) -> dict[int, int]:
        return dict(self._prefill_tokens)

    def set_peer_load(self, load: Mapping[int, NodeLoad]) -> None:
        """Other gateways' outstanding work (from the shared gateway-load hash), added to ours."""
        self._peer_load = load

    def load_view(self) -> dict[int, NodeLoad]:
        """A fresh node id -> ``NodeLoad`` map (ours plus peers'), safe to hand to an algorithm."""
        prefill = self._prefill_tokens
        view = {
            node_id: NodeLoad(requests, prefill[node_id])
            for node_id, requests in self._requests.items()
            if requests or prefill[node_id]
        }
        for node_id, peer in self._peer_load.items():
            own = view.get(node_id)
            if own is None:
                view[node_id] = peer
            else:
                view[node_id] = NodeLoad(
                    own.outstanding_requests + peer.outstanding_requests,
                    own.outstanding_prefill_tokens + peer.outstanding_prefill_tokens,
                )
        return view
