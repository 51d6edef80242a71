"""WAN emulation: the delay a request from another region sees on its way to a node and back.

A request carrying ``X-Gorgo-Region: <region>`` is held for half the round trip between that
region and the node's region before it is processed, and every byte of its response reaches the
client half a round trip after the node produced it. Jitter is additive (propagation delay is a
floor, queueing in the network only adds to it): each direction adds a uniform draw from
``[0, jitter_ms / 2]``. Draws come from a ``random.Random`` seeded by the topology seed and the
node name, so runs repeat. Without the header, or with a region the topology does not know,
there is no delay.
"""

from __future__ import annotations

import random

from simulator.topology import Topology

REGION_HEADER = "X-Gorgo-Region"


class WANEmulator:
    """Delays for requests reaching one node, by client region."""

    def __init__(
        self, topology: Topology, node_name: str, node_region: str, *, time_scale: float = 1.0
    ) -> None:
        self._topology = topology
        self._node_region = node_region
        self._time_scale = time_scale
        # A string seed is hashed with SHA-512 by ``random``, so it is stable across processes.
        self._rng = random.Random(f"{topology.seed}:{node_name}")

    def one_way_delays_s(self, client_region: str | None) -> tuple[float, float]:
        """(inbound, outbound) delay in seconds for a request from ``client_region``."""
        if not client_region or not self._topology.has_region(client_region):
            return 0.0, 0.0
        rtt_ms = self._topology.rtt_ms(client_region, self._node_region)
        jitter_ms = self._topology.jitter_ms(client_region, self._node_region)
        half_jitter_ms = jitter_ms / 2.0
        scale = self._time_scale / 1000.0
        inbound = (rtt_ms / 2.0 + self._rng.uniform(0.0, half_jitter_ms)) * scale
        outbound = (rtt_ms / 2.0 + self._rng.uniform(0.0, half_jitter_ms)) * scale
        return inbound, outbound
