"""Client keys end to end: made and revoked through the REST API, enforced by two gateway processes.

Control plane, gateways and the node run as real processes sharing one Redis namespace; the test
writes nothing to Redis itself. The official ``openai`` SDK is the client.
"""

from __future__ import annotations

import sys
import time

import openai
import pytest
import redis

from tests.conftest import delete_namespace, start_celery
from tests.e2e.test_control_plane_to_gateway import register_fleet
from tests.routing.support import MODEL
from tests.routing.test_e2e_gateway import start_fleet, start_gateway

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "hi"}]


def sdk(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=30)


def chat(client: openai.OpenAI):
    return client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2)


@pytest.fixture
def fleet_and_gateways(control_plane, processes, redis_url, redis_keys):
    urls = start_fleet(processes, names=("us-east-1",))
    with control_plane.api() as api:
        register_fleet(api, urls)
        policy = api.post(
            "/policies/", json={"name": "default", "algorithm": "least_load", "params": {}}
        ).json()
        assert api.post(f"/policies/{policy['id']}/publish/", json={"note": "e2e"}).status_code == 201
    auth_on = {"GORGO_AUTH": "on"}
    gateways = [
        start_gateway(processes, redis_url, redis_keys, name=f"gateway-{index}", env=auth_on)
        for index in (1, 2)
    ]
    return control_plane, gateways


def test_a_key_made_and_revoked_through_the_api_reaches_both_gateways(fleet_and_gateways) -> None:
    control_plane, gateways = fleet_and_gateways
    with control_plane.api() as api:
        created = api.post("/client-keys/", json={"name": "e2e", "owner": "tests", "models": [MODEL]})
        assert created.status_code == 201, created.text
        key = created.json()
        clients = [sdk(gateway, key["secret"]) for gateway in gateways]

        def served_everywhere() -> bool:
            try:
                return all(chat(client).status_code == 200 for client in clients)
            except openai.AuthenticationError:
                return False

        deadline = time.monotonic() + 5
        while not served_everywhere():
            assert time.monotonic() < deadline, "the new key did not reach both gateways"
            time.sleep(0.05)

        # The SDK gets OpenAI's auth errors, and models.retrieve works.
        with pytest.raises(openai.AuthenticationError) as caught:
            chat(sdk(gateways[0], "gorgo-sk-nope-not-a-key"))
        assert caught.value.code == "invalid_api_key"
        assert clients[0].models.retrieve(MODEL).id == MODEL

        assert api.post(f"/client-keys/{key['id']}/revoke/").status_code == 200
        revoked_at = time.monotonic()
        refused: set[int] = set()
        while len(refused) < 2:
            for index, client in enumerate(clients):
                try:
                    chat(client)
                except openai.AuthenticationError:
                    refused.add(index)
            assert time.monotonic() - revoked_at < 1.0, "a revocation took more than a second"


def test_limits_hold_across_two_gateways_and_the_sdk_sees_the_retry_headers(fleet_and_gateways) -> None:
    control_plane, gateways = fleet_and_gateways
    with control_plane.api() as api:
        created = api.post(
            "/client-keys/", json={"name": "limited", "owner": "tests", "requests_per_min": 30}
        )
        assert created.status_code == 201, created.text
    secret = created.json()["secret"]
    clients = [sdk(gateway, secret) for gateway in gateways]
    deadline = time.monotonic() + 5
    while True:  # until the key set reached both gateways
        try:
            for client in clients:
                chat(client)
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    admitted, limited = 2, None
    for index in range(60):
        try:
            chat(clients[index % 2])
            admitted += 1
        except openai.RateLimitError as exc:
            limited = exc
    assert 30 <= admitted <= 33  # one shared limit of 30/min (plus what refilled), not 30 per gateway
    assert limited is not None and limited.code == "rate_limit_exceeded"
    headers = limited.response.headers
    assert int(headers["retry-after"]) >= 1 and headers["x-ratelimit-limit-requests"] == "30"
    assert headers["x-ratelimit-remaining-requests"] == "0"


def test_an_empty_redis_gets_the_keys_and_the_policy_back_by_itself(
    fleet_and_gateways, processes, redis_url, redis_keys
) -> None:
    """A failover to an empty Redis: the reconcile writes the key set (and the policy) back within
    seconds, and a gateway started afterwards serves a valid key. Before, the policy came back but
    the key set never did: every new gateway answered 401 until someone ran publish_keys."""
    control_plane, _gateways = fleet_and_gateways
    with control_plane.api() as api:
        created = api.post("/client-keys/", json={"name": "e2e", "owner": "tests", "models": [MODEL]})
        assert created.status_code == 201, created.text
    secret = created.json()["secret"]
    start_celery(processes, redis_keys.prefix, {}, concurrency=1)  # beat: the default interval
    client = redis.Redis.from_url(redis_url)
    assert client.exists(redis_keys.key_set, redis_keys.policy_current) == 2

    delete_namespace(client, redis_keys.prefix)  # every key of ours: policy, keys, Celery's too
    lost_at = time.monotonic()
    while client.exists(redis_keys.key_set, redis_keys.policy_current) < 2:
        assert time.monotonic() - lost_at < 60, processes.logs()
        time.sleep(0.1)
    back_s = time.monotonic() - lost_at
    sys.stdout.write(f"keys and policy back {back_s:.1f} s after the namespace was emptied\n")

    fresh = start_gateway(processes, redis_url, redis_keys, name="gateway-after", env={"GORGO_AUTH": "on"})
    assert chat(sdk(fresh, secret)).status_code == 200
