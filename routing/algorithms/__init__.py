"""The routing algorithms the gateway knows, by the name a policy uses.

Each algorithm module exposes ``INFO`` (an ``AlgorithmInfo``); add it to ``REGISTRY`` below. A
snapshot whose algorithm is not registered is refused by the gateway (logged, old policy kept).
"""

from __future__ import annotations

from routing.algorithms import gorgo, least_load, prefix_affinity, round_robin, session_affinity
from routing.algorithms.base import AlgorithmInfo

REGISTRY: dict[str, AlgorithmInfo] = {
    info.name: info
    for info in (
        round_robin.INFO,
        least_load.INFO,
        session_affinity.INFO,
        prefix_affinity.INFO,
        gorgo.INFO,
    )
}
