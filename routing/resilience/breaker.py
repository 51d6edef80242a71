"""Per-node circuit breakers: the gateway's own, first-hand view of which nodes fail.

Telemetry marks nodes unhealthy within seconds, but it can be late or stopped, and a stale live
entry counts as "unmeasured" (routable). The breaker does not depend on it: a node the gateway saw
fail gets no client request until the gateway's own probe (``routing/resilience/node_probe.py``, a
``GET /health`` to the node) succeeds, whatever the live state says.

- closed: routed normally. ``failure_threshold`` consecutive soft failures (5xx answers, dropped
  connections) open it; a hard failure (refused connection, no first byte in time, a stream gone
  silent) opens it at once.
- open: no requests for ``open_s``; then a probe is due.
- half-open: the probe runs. Success closes the breaker; failure opens it again for twice as
  long, up to ``max_open_s``.
- ``recovered``: someone else saw the node answer again (telemetry's health check, which had
  marked it down): its probe is due at once instead of at the end of its wait, which has doubled
  up to ``max_open_s`` (a minute) by the time a long outage ends. The probe still decides.

Pure bookkeeping on the event loop: no I/O, no locks; time comes in as arguments. The request
path reads one attribute (``blocked``), rebuilt on every transition.
"""

from __future__ import annotations

from typing import Final

CLOSED: Final = 0
HALF_OPEN: Final = 1
OPEN: Final = 2


class _NodeBreaker:
    __slots__ = ("failures", "open_s", "open_until", "state")

    def __init__(self, open_s: float) -> None:
        self.state = CLOSED
        self.failures = 0
        self.open_s = open_s
        self.open_until = 0.0


class Breakers:
    """One breaker per node id; only nodes that failed since their last success have an entry."""

    def __init__(self, *, failure_threshold: int = 5, open_s: float = 5.0, max_open_s: float = 60.0) -> None:
        self._failure_threshold = failure_threshold
        self._open_s = open_s
        self._max_open_s = max_open_s
        self._nodes: dict[int, _NodeBreaker] = {}
        self.blocked: frozenset[int] = frozenset()  # nodes not to route to (open or half-open)

    def _update_blocked(self) -> None:
        self.blocked = frozenset(node_id for node_id, node in self._nodes.items() if node.state != CLOSED)

    def next_probe_in_s(self, now_s: float) -> float:
        """How long until some open node is probed (for a Retry-After)."""
        waits = [node.open_until - now_s for node in self._nodes.values() if node.state == OPEN]
        return max(0.0, min(waits)) if waits else 0.0

    def success(self, node_id: int) -> None:
        """A node answered (a request or a probe): close its breaker."""
        node = self._nodes.pop(node_id, None)
        if node is not None and node.state != CLOSED:
            self._update_blocked()

    def failure(self, node_id: int, now_s: float, *, hard: bool) -> None:
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _NodeBreaker(self._open_s)
        node.failures += 1
        if node.state == CLOSED and not (hard or node.failures >= self._failure_threshold):
            return
        if node.state == HALF_OPEN:
            node.open_s = min(node.open_s * 2, self._max_open_s)  # the probe failed: wait longer
        if node.state == OPEN:
            return  # requests that were already under way when it opened
        node.state = OPEN
        node.open_until = now_s + node.open_s
        self._update_blocked()

    def recovered(self, node_id: int, now_s: float) -> None:
        """The node is reported answering again: make its probe due now (if it waits for one)."""
        node = self._nodes.get(node_id)
        if node is not None and node.state == OPEN and node.open_until > now_s:
            node.open_until = now_s

    def due_probes(self, now_s: float) -> list[int]:
        """Open nodes whose wait is over; they become half-open while the caller probes them."""
        due = [
            node_id
            for node_id, node in self._nodes.items()
            if node.state == OPEN and node.open_until <= now_s
        ]
        for node_id in due:
            self._nodes[node_id].state = HALF_OPEN
        return due

    def states(self) -> dict[int, int]:
        """Node id -> 0 closed, 1 half-open, 2 open (nodes that never failed are not listed)."""
        return {node_id: node.state for node_id, node in self._nodes.items()}


class RetryBudget:
    """Retries may add at most ``ratio`` extra requests (plus a small reserve for quiet gateways).

    Each forwarded request deposits ``ratio`` of a retry; each retry spends one. The balance is
    capped at ``reserve``, so a burst of failures after a quiet spell cannot retry unboundedly.
    """

    def __init__(self, ratio: float = 0.1, reserve: float = 10.0) -> None:
        self._ratio = ratio
        self._reserve = reserve
        self._balance = reserve

    def deposit(self) -> None:
        balance = self._balance + self._ratio
        self._balance = balance if balance < self._reserve else self._reserve

    def spend(self) -> bool:
        if self._balance >= 1.0:
            self._balance -= 1.0
            return True
        return False
