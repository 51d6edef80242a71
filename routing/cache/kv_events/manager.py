"""All KV-event subscribers of one gateway: started, stopped and asked for a node's mode."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq.asyncio

from routing.cache.kv_events.subscriber import EventSource, Mode, NodeSubscriber
from routing.cache.precise_index import PreciseIndex
from routing.contract import SCHEMA_VERSION, GatewayKVState, NodeKVState


class KVEvents:
    """The gateway's subscribers, one per node with an events endpoint in the snapshot."""

    def __init__(self, index: PreciseIndex | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.index = index if index is not None else PreciseIndex()
        self._clock = clock
        self._ctx: zmq.asyncio.Context | None = None
        self.subscribers: dict[int, NodeSubscriber] = {}

    def now(self) -> float:
        """The subscribers' clock (unix s; tests move it)."""
        return self._clock()

    def mode(self, node_id: int, now_s: float | None = None) -> Mode:
        subscriber = self.subscribers.get(node_id)
        if subscriber is None:
            return "approximate"
        return subscriber.mode(self._clock() if now_s is None else now_s)

    def note_served(self, node_id: int) -> None:
        """The node answered a request this gateway sent (events are due: see ``silent``)."""
        subscriber = self.subscribers.get(node_id)
        if subscriber is not None:
            subscriber.note_served(self._clock())

    async def sync(self, sources: dict[int, EventSource]) -> None:
        """Start subscribers for new sources, stop those gone or changed."""
        if self._ctx is None and sources:
            self._ctx = zmq.asyncio.Context()
        for node_id, subscriber in list(self.subscribers.items()):
            if sources.get(node_id) != subscriber.source:
                del self.subscribers[node_id]
                await subscriber.stop()
        for node_id, source in sources.items():
            if node_id not in self.subscribers:
                assert self._ctx is not None
                subscriber = NodeSubscriber(node_id, source, self.index, self._ctx, clock=self._clock)
                self.subscribers[node_id] = subscriber
                subscriber.start()

    def state(self, gateway_id: str, region: str) -> GatewayKVState:
        """This gateway's view of every node it subscribes to (what the dashboard shows)."""
        now = self._clock()
        return GatewayKVState(
            schema_version=SCHEMA_VERSION,
            gateway_id=gateway_id,
            region=region,
            updated_at=now,
            nodes={
                node_id: NodeKVState(
                    mode=subscriber.mode(now),
                    lag_s=subscriber.stats.last_lag_s,
                    blocks=self.index.blocks(node_id),
                    gaps=subscriber.stats.gaps,
                    received=subscriber.stats.received,
                    silent=subscriber.silent(now),
                )
                for node_id, subscriber in self.subscribers.items()
            },
        )

    async def close(self) -> None:
        await self.sync({})
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
