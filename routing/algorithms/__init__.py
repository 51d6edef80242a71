"""The routing algorithms the gateway knows, by the name a policy uses.

Each algorithm module exposes ``INFO`` (an ``AlgorithmInfo``: its params struct from
``routing/contract.py``, whose tag is the algorithm's name, its label and its ``choose``); add it to
``REGISTRY`` below. The control plane's choices are derived from this registry, and a system check
(``policies``) plus a test keep it equal to the contract's ``ALGORITHMS``. A snapshot whose
algorithm is not registered is refused by the gateway (logged, old policy kept).
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
