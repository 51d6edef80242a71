"""Helpers for the KV-event tests: blocks to publish, and a publisher that can lose a batch."""

from __future__ import annotations

import time

from simulator.kv_events import BlockStored, Publisher, encode_batch


def stored(first: int, count: int = 1, parent: int | None = None) -> BlockStored:
    """Blocks ``first`` .. ``first + count - 1``, each of 16 tokens (its own number), chained."""
    return BlockStored(
        tuple(range(first, first + count)),
        parent,
        tuple(t for block in range(first, first + count) for t in [block] * 16),
        16,
    )


class LossyPublisher(Publisher):
    """The simulator's publisher, able to lose a batch on the way (as an overflowing HWM, or ZMQ's
    slow joiner, does): numbered and kept in the replay buffer, never sent."""

    def lose(self, events: list) -> None:
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, encode_batch(events, time.time(), 0, self.config.encoding)))
