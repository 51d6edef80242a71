"""Nodes name their KV-event endpoints and models their tokenizer; both reach the gateways' snapshot."""

from __future__ import annotations

import pytest

from controlplane.policies.models import RoutingPolicy
from routing.contract import KVEventsSpec, TokenizerSpec
from tests.controlplane.support import LLAMA, live_snapshot

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def live(operator_client, fleet, redis_conn, cp_keys):
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo")
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    return lambda: live_snapshot(redis_conn, cp_keys)


def test_a_nodes_event_endpoints_are_compiled_into_the_snapshot(operator_client, fleet, live) -> None:
    node = fleet.nodes["us-east-1"]
    assert next(n for n in live().nodes if n.name == "us-east-1").kv_events is None
    response = operator_client.patch(
        f"/api/v1/nodes/{node.pk}/",
        {"kv_events_endpoint": "tcp://10.0.0.5:5557", "kv_events_replay_endpoint": "tcp://10.0.0.5:5558"},
        format="json",
    )
    assert response.status_code == 200, response.content
    compiled = next(n for n in live().nodes if n.name == "us-east-1")
    assert compiled.kv_events == KVEventsSpec("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "")


def test_vllms_own_bind_address_is_accepted_and_nonsense_refused(operator_client, fleet, live) -> None:
    # vLLM binds tcp://*:P; gateways read "*" as the node's host (issue 26, item 1).
    node = fleet.nodes["us-east-1"]
    response = operator_client.patch(
        f"/api/v1/nodes/{node.pk}/", {"kv_events_endpoint": "tcp://*:5557"}, format="json"
    )
    assert response.status_code == 200, response.content
    compiled = next(n for n in live().nodes if n.name == "us-east-1")
    assert compiled.kv_events == KVEventsSpec("tcp://*:5557", None, "")
    for bad in ("tcp://*", "http://10.0.0.5:5557", "tcp://a b:1"):
        response = operator_client.patch(
            f"/api/v1/nodes/{node.pk}/", {"kv_events_endpoint": bad}, format="json"
        )
        assert response.status_code == 400
        assert "kv_events_endpoint" in response.json()
    operator_client.patch(f"/api/v1/nodes/{node.pk}/", {"kv_events_endpoint": ""}, format="json")
    response = operator_client.patch(
        f"/api/v1/nodes/{node.pk}/", {"kv_events_replay_endpoint": "tcp://10.0.0.5:5558"}, format="json"
    )
    assert response.status_code == 400
    assert "kv_events_endpoint" in response.json()


def test_a_models_tokenizer_is_compiled_into_the_snapshot(operator_client, fleet, live) -> None:
    model = fleet.model
    response = operator_client.patch(
        f"/api/v1/models/{model.pk}/",
        {"tokenizer_path": "/models/llama/tokenizer.json", "chat_template_path": "/models/llama/chat.jinja"},
        format="json",
    )
    assert response.status_code == 200, response.content
    compiled = next(m for m in live().models if m.name == LLAMA)
    assert compiled.tokenizer == TokenizerSpec("/models/llama/tokenizer.json", "/models/llama/chat.jinja")


def test_a_chat_template_without_its_tokenizer_is_refused(operator_client, fleet) -> None:
    response = operator_client.patch(
        f"/api/v1/models/{fleet.model.pk}/", {"chat_template_path": "/models/chat.jinja"}, format="json"
    )
    assert response.status_code == 400
    assert "tokenizer_path" in response.json()


def test_a_models_folder_and_lora_flag_are_compiled_into_the_snapshot(operator_client, fleet, live) -> None:
    model = fleet.model
    response = operator_client.patch(
        f"/api/v1/models/{model.pk}/", {"model_folder": "/models/llama", "lora_adapter": True}, format="json"
    )
    assert response.status_code == 200, response.content
    compiled = next(m for m in live().models if m.name == LLAMA)
    assert compiled.model_folder == "/models/llama" and compiled.lora_adapter and compiled.tokenizer is None
