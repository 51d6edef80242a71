"""Per-node admission and a bounded priority queue for when every eligible node is full.

A node takes at most ``ceil(max_num_seqs * factor)`` outstanding requests (this gateway's plus its
peers', as ``routing/state/inflight.py`` knows them): vLLM runs ``max_num_seqs`` at once and queues the
rest itself, where the gateway can no longer reorder them or send them elsewhere. When every
eligible node is at its bound, a request waits here, ``interactive`` before ``batch`` and first come
first served within a class, for at most ``max_wait_s``; the queue holds at most ``max_length``
requests (an interactive arrival at a full queue takes the place of the newest batch waiter).
Refusals are 503 with ``Retry-After``: never unbounded memory or waiting.

A freed slot is handed to the first waiter that can use it and reserved for it until it resumes,
so a new arrival cannot take it meanwhile. Waiters also look again every ``_POLL_S`` (peers' load
changes arrive without a release here).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Final

from routing.contract import NodeSpec
from routing.errors import GatewayError
from routing.state.inflight import InFlight

_POLL_S: Final = 0.1
INTERACTIVE: Final = "interactive"
BATCH: Final = "batch"
FULL: Final = "full"
TIMEOUT: Final = "timeout"


class _Waiter:
    __slots__ = ("future", "node_ids", "priority")

    def __init__(self, node_ids: frozenset[int], priority: str) -> None:
        self.node_ids = node_ids
        self.priority = priority
        self.future: asyncio.Future[int] = asyncio.get_running_loop().create_future()


class Admission:
    """Capacity checks on the request path; the queue only when every candidate is full."""

    def __init__(
        self,
        inflight: InFlight,
        *,
        factor: float = 2.0,
        max_length: int = 512,
        max_wait_s: float = 5.0,
        on_wait: Callable[[str, float], None] | None = None,
        on_reject: Callable[[str, str], None] | None = None,
    ) -> None:
        # Outstanding requests per node, ours + peers' (a native call, compiled: a callable stored
        # here was a generic call per candidate and request).
        self._inflight = inflight
        self._factor = factor
        self._max_length = max_length
        self._max_wait_s = max_wait_s
        self._on_wait = on_wait
        self._on_reject = on_reject
        self._reserved: dict[int, int] = {}
        self._queues: dict[str, deque[_Waiter]] = {INTERACTIVE: deque(), BATCH: deque()}
        self._waiting = 0

    @property
    def enabled(self) -> bool:
        return self._factor > 0

    def lengths(self) -> dict[str, int]:
        return {priority: len(queue) for priority, queue in self._queues.items()}

    def _has_room(self, node: NodeSpec) -> bool:
        # Below ceil(max_num_seqs * factor): for a whole count, the same as below the product.
        taken = self._inflight.outstanding(node.id)
        reserved = self._reserved
        if reserved:
            taken += reserved.get(node.id, 0)
        return taken < node.max_num_seqs * self._factor

    def with_room(self, candidates: tuple[NodeSpec, ...]) -> tuple[NodeSpec, ...]:
        """The candidates below their bound (all of them, in the common case, without copying)."""
        if not self._factor:
            return candidates
        if self._waiting == 0 and all(self._has_room(node) for node in candidates):
            return candidates
        if self._queues[INTERACTIVE]:
            return ()  # others are waiting: a newcomer queues behind them
        return tuple(node for node in candidates if self._has_room(node))

    async def wait(self, candidates: tuple[NodeSpec, ...], priority: str) -> NodeSpec:
        """Queue until one of ``candidates`` has room; return it, its slot reserved for the caller
        until ``claim``. Raises a 503 ``GatewayError`` when the queue is full or the wait too long."""
        queue = self._queues[priority if priority in self._queues else INTERACTIVE]
        if self._waiting >= self._max_length:
            batch = self._queues[BATCH]
            if priority == INTERACTIVE and batch:
                evicted = batch.pop()  # the newest batch waiter makes room for an interactive one
                self._waiting -= 1
                evicted.future.set_exception(self._refusal(BATCH, FULL))
            else:
                raise self._refusal(priority, FULL)
        waiter = _Waiter(frozenset(node.id for node in candidates), priority)
        queue.append(waiter)
        self._waiting += 1
        started_s = time.monotonic()
        deadline_s = started_s + self._max_wait_s
        granted: int | None = None
        try:
            while True:
                if waiter.future.done():  # a slot was handed over (or the waiter evicted: raises)
                    granted = waiter.future.result()
                    return next(node for node in candidates if node.id == granted)
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    raise self._refusal(priority, TIMEOUT)
                try:
                    await asyncio.wait_for(asyncio.shield(waiter.future), min(remaining_s, _POLL_S))
                    continue
                except TimeoutError:
                    pass
                if (
                    queue
                    and queue[0] is waiter
                    and (priority == INTERACTIVE or not self._queues[INTERACTIVE])
                ):
                    room = [node for node in candidates if self._has_room(node)]
                    if room:
                        granted = room[0].id
                        self._reserve(granted)
                        return room[0]
        except BaseException:
            if granted is None and waiter.future.done() and not waiter.future.exception():
                # Cancelled (the client left) just as a slot was handed over: pass it on.
                node_id = waiter.future.result()
                self.claim(node_id)
                self.released(node_id)
            raise
        finally:
            if waiter in queue:
                queue.remove(waiter)
                self._waiting -= 1
            if self._on_wait is not None:
                self._on_wait(priority, time.monotonic() - started_s)

    def claim(self, node_id: int) -> None:
        """The waiter resumed and is about to take its slot (call it, then begin the lease, with no
        await in between)."""
        left = self._reserved.get(node_id, 0) - 1
        if left > 0:
            self._reserved[node_id] = left
        else:
            self._reserved.pop(node_id, None)

    def released(self, node_id: int) -> None:
        """A request on ``node_id`` finished: hand its slot to the first waiter that can use it."""
        if not self._waiting:
            return
        for queue in self._queues.values():
            for waiter in queue:
                if node_id in waiter.node_ids and not waiter.future.done():
                    queue.remove(waiter)
                    self._waiting -= 1
                    self._reserve(node_id)
                    waiter.future.set_result(node_id)
                    return

    def _reserve(self, node_id: int) -> None:
        self._reserved[node_id] = self._reserved.get(node_id, 0) + 1

    def _refusal(self, priority: str, reason: str) -> GatewayError:
        if self._on_reject is not None:
            self._on_reject(priority, reason)
        message = (
            "Every eligible node is at capacity and the gateway's queue is full."
            if reason == FULL
            else f"Every eligible node stayed at capacity for {self._max_wait_s:g}s."
        )
        return GatewayError(503, message, retry_after_s=1)
