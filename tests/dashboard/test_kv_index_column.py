"""The Nodes and Cache pages show how the gateways index each node: precise (KV events) or approximate."""

from __future__ import annotations

import re
import time

import pytest
import redis
from django.test import Client

from routing import contract
from routing.contract import GatewayKVState, NodeKVState, RedisKeys
from tests.dashboard.conftest import Fleet


def kv_cell(html: str, node_id: int) -> str:
    row = re.search(rf'<tr data-node-id="{node_id}".*?</tr>', html, re.S)
    assert row is not None
    return row.group(0)


def report(redis_conn: redis.Redis, keys: RedisKeys, gateway: str, nodes: dict, age_s: float = 0.0) -> None:
    state = GatewayKVState(contract.SCHEMA_VERSION, gateway, "us-east", time.time() - age_s, nodes)
    redis_conn.hset(keys.kv_state, gateway, contract.encode(state))


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/nodes/", "/cache/"])
def test_it_shows_each_nodes_mode_and_event_lag(
    viewer_client: Client, fleet: Fleet, redis_conn: redis.Redis, cp_keys: RedisKeys, path: str
) -> None:
    precise = fleet.nodes["eu-central-1"].pk
    mixed = fleet.nodes["us-east-1"].pk
    report(
        redis_conn,
        cp_keys,
        "gw-a",
        {
            precise: NodeKVState("precise", lag_s=0.0042, blocks=120),
            mixed: NodeKVState("precise", lag_s=0.01),
        },
    )
    report(redis_conn, cp_keys, "gw-b", {mixed: NodeKVState("approximate", lag_s=7.5)})
    report(redis_conn, cp_keys, "gw-gone", {precise: NodeKVState("approximate")}, age_s=60)  # stale

    html = viewer_client.get(path).content.decode()

    cell = kv_cell(html, precise)
    assert "kv-precise" in cell and ">precise<" in cell and "0.004 s" in cell
    cell = kv_cell(html, mixed)
    assert ">mixed<" in cell and "7.500 s" in cell  # the worst lag any gateway sees
    other = kv_cell(html, fleet.nodes["ap-south-1"].pk)
    assert ">approximate<" in other


@pytest.mark.django_db
def test_a_node_that_serves_and_sends_no_event_is_flagged_on_the_nodes_page(
    viewer_client: Client, fleet: Fleet, redis_conn: redis.Redis, cp_keys: RedisKeys
) -> None:
    silent = fleet.nodes["us-east-1"].pk
    fine = fleet.nodes["eu-central-1"].pk
    report(
        redis_conn,
        cp_keys,
        "gw-a",
        {silent: NodeKVState("approximate", silent=True), fine: NodeKVState("precise", lag_s=0.01)},
    )
    html = viewer_client.get("/nodes/").content.decode()
    cell = kv_cell(html, silent)
    assert 'data-field="kv_silent"' in cell and ">no events<" in cell
    assert "binds its events endpoint only when it contains *" in cell
    assert "kv_silent" not in kv_cell(html, fine)
