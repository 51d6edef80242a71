"""session_affinity: a consistent hash ring on the session key, least load without a key."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

from routing.algorithms import session_affinity
from routing.algorithms.base import NodeLoad, RoutingRequest, RoutingView
from routing.contract import NodeSpec, SessionAffinityParams
from tests.conftest import ROOT
from tests.routing.support import MODEL, make_node

KEYS = [f"session-{index}" for index in range(5_000)]


def owner(nodes: tuple[NodeSpec, ...], key: str | None, load: dict[int, NodeLoad] | None = None) -> int:
    view = RoutingView(region="us-east", candidates=nodes, params=SessionAffinityParams(), load=load or {})
    return session_affinity.choose(view, RoutingRequest(MODEL, 100, 25, session_key=key)).node.id


def test_it_keeps_a_session_on_one_node_and_spreads_sessions_evenly() -> None:
    nodes = tuple(make_node(i) for i in range(1, 6))
    assert {owner(nodes, "alice") for _ in range(10)} == {owner(nodes, "alice")}
    shares = Counter(owner(nodes, key) for key in KEYS)
    assert set(shares) == {1, 2, 3, 4, 5}
    assert max(shares.values()) < 1.35 * len(KEYS) / 5  # 160 virtual nodes each


def test_it_moves_only_the_leaving_nodes_sessions() -> None:
    before_nodes = tuple(make_node(i) for i in range(1, 6))
    after_nodes = tuple(node for node in before_nodes if node.id != 3)
    before = {key: owner(before_nodes, key) for key in KEYS}
    after = {key: owner(after_nodes, key) for key in KEYS}

    moved = {key for key in KEYS if before[key] != after[key]}
    assert moved == {key for key in KEYS if before[key] == 3}
    # ... and they spread over the remaining nodes rather than all landing on one.
    assert len({after[key] for key in moved}) == 4


def test_it_maps_a_session_the_same_way_in_every_process() -> None:
    code = (
        "from routing.algorithms.session_affinity import ring_hash; "
        "print(ring_hash('alice'), ring_hash('bob'))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "99"}
    output = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert output.stdout.split() == [
        str(session_affinity.ring_hash("alice")),
        str(session_affinity.ring_hash("bob")),
    ]


def test_it_falls_back_to_least_load_without_a_session_key() -> None:
    nodes = tuple(make_node(i) for i in range(1, 4))
    load = {1: NodeLoad(4, 0), 2: NodeLoad(1, 0), 3: NodeLoad(2, 0)}
    assert owner(nodes, None, load) == 2
    assert owner(nodes, "", load) == 2
