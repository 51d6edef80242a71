"""The one snapshot writer: compare-and-set the policy snapshot, then announce it."""

from __future__ import annotations

import redis

from routing import contract
from routing.contract import ClientKeySet, KeySetAnnouncement, PolicyAnnouncement, PolicySnapshot, RedisKeys
from routing.writer import current_version
from routing.writer import write as write_snapshot
from tests.routing.support import make_node, make_snapshot


def test_it_writes_and_announces_a_newer_snapshot(redis_url: str, redis_keys: RedisKeys) -> None:
    client = redis.Redis.from_url(redis_url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(redis_keys.policy_channel)
    pubsub.get_message(timeout=1.0)  # the subscribe confirmation
    snapshot = make_snapshot((make_node(1),), version=3)

    assert write_snapshot(client, redis_keys, snapshot)

    stored = contract.decode(client.get(redis_keys.policy_current), PolicySnapshot)
    assert stored.version == 3 and current_version(client, redis_keys) == 3
    message = pubsub.get_message(timeout=2.0)
    assert message is not None
    assert contract.decode(message["data"], PolicyAnnouncement).version == 3
    pubsub.close()


def test_it_never_replaces_a_newer_snapshot(redis_url: str, redis_keys: RedisKeys) -> None:
    client = redis.Redis.from_url(redis_url)
    assert write_snapshot(client, redis_keys, make_snapshot((make_node(1),), version=5))

    assert not write_snapshot(client, redis_keys, make_snapshot((make_node(2),), version=4))

    stored = contract.decode(client.get(redis_keys.policy_current), PolicySnapshot)
    assert stored.version == 5 and stored.nodes[0].id == 1


def test_it_replaces_an_unreadable_document(redis_url: str, redis_keys: RedisKeys) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set(redis_keys.policy_current, b"not json")
    assert current_version(client, redis_keys) == 0

    assert write_snapshot(client, redis_keys, make_snapshot((make_node(1),), version=1))
    assert current_version(client, redis_keys) == 1


def test_it_writes_the_key_set_through_the_same_compare_and_set(
    redis_url: str, redis_keys: RedisKeys
) -> None:
    client = redis.Redis.from_url(redis_url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(redis_keys.key_channel)
    pubsub.get_message(timeout=1.0)  # the subscribe confirmation

    assert write_snapshot(client, redis_keys, ClientKeySet(contract.SCHEMA_VERSION, 7, 0.0, ()))
    assert not write_snapshot(client, redis_keys, ClientKeySet(contract.SCHEMA_VERSION, 6, 0.0, ()))

    assert contract.decode(client.get(redis_keys.key_set), ClientKeySet).version == 7
    message = pubsub.get_message(timeout=2.0)
    assert message is not None and contract.decode(message["data"], KeySetAnnouncement).version == 7
    assert client.get(redis_keys.policy_current) is None  # the key set never lands on the policy's key
