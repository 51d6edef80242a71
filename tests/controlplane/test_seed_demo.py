"""``manage.py seed_demo``: the demo fleet, a published gorgo policy and an operator; twice is once."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core import serializers
from django.core.management import CommandError, call_command
from rest_framework.authtoken.models import Token

from controlplane.connections import redis_client
from controlplane.fleet.models import LLMModel, Node, Region
from controlplane.policies.models import PolicyVersion, RoutingPolicy
from tests.controlplane.support import LLAMA, client_for, live_snapshot

pytestmark = pytest.mark.django_db(transaction=True)  # on_commit republishes must run as in production


def seed() -> str:
    out = StringIO()
    call_command("seed_demo", stdout=out)
    return out.getvalue()


def database_dump() -> str:
    objects = [
        *Region.objects.all(),
        *LLMModel.objects.all(),
        *Node.objects.all(),
        *RoutingPolicy.objects.all(),
        *PolicyVersion.objects.all(),
        *get_user_model().objects.all(),
        *Token.objects.all(),
    ]
    return serializers.serialize("json", objects)


def test_it_seeds_the_demo_fleet_and_publishes_it(redis_conn, cp_keys, monkeypatch) -> None:
    monkeypatch.setenv("GORGO_OPERATOR_PASSWORD", "demo-password-1")
    output = seed()
    coordinates = {r.slug: (r.latitude, r.longitude) for r in Region.objects.all()}
    assert coordinates == {
        "us-east": (39.04, -77.49),
        "eu-central": (50.11, 8.68),
        "ap-south": (19.08, 72.88),
    }
    nodes = {n.name: (n.region.slug, n.base_url) for n in Node.objects.select_related("region")}
    assert nodes == {
        "us-east-1": ("us-east", "http://127.0.0.1:8101"),
        "us-east-2": ("us-east", "http://127.0.0.1:8102"),
        "eu-central-1": ("eu-central", "http://127.0.0.1:8103"),
        "eu-central-2": ("eu-central", "http://127.0.0.1:8104"),
        "ap-south-1": ("ap-south", "http://127.0.0.1:8105"),
        "ap-south-2": ("ap-south", "http://127.0.0.1:8106"),
    }
    assert all(list(n.served_models.values_list("name", flat=True)) == [LLAMA] for n in Node.objects.all())

    policy = RoutingPolicy.objects.get(name="default")
    assert (policy.algorithm, policy.is_active) == ("gorgo", True)
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert (snapshot.version, snapshot.policy.name, len(snapshot.nodes)) == (1, "default", 6)
    # Every demo node publishes KV events, and the model is given by the emulated one's folder.
    events = {n.name: n.kv_events for n in snapshot.nodes}
    assert events["us-east-1"].endpoint == "tcp://127.0.0.1:8111"
    assert events["ap-south-2"].replay_endpoint == "tcp://127.0.0.1:8126"
    (model,) = snapshot.models
    assert model.tokenizer is None and model.model_folder is not None
    assert model.model_folder.endswith("simulator/model_files")

    operator = get_user_model().objects.get(username="operator")
    assert operator.check_password("demo-password-1")
    token = Token.objects.get(user=operator).key
    assert f"API token: {token}" in output
    assert client_for(token).get("/api/v1/nodes/").json()["count"] == 6


def test_it_changes_nothing_when_run_twice(redis_conn, cp_keys) -> None:
    first = seed()
    assert "Password: " in first  # generated: no GORGO_OPERATOR_PASSWORD in the environment
    before = database_dump()
    second = seed()
    assert database_dump() == before
    assert "Password: " not in second
    assert "already live as version 1" in second
    assert live_snapshot(redis_conn, cp_keys).version == 1


def test_it_keeps_what_operators_changed(redis_conn, cp_keys) -> None:
    seed()
    Node.objects.get(name="us-east-1").set_state("draining")  # republished as version 2
    seed()
    assert Node.objects.get(name="us-east-1").state == "draining"
    assert live_snapshot(redis_conn, cp_keys).version == 2
    assert PolicyVersion.objects.count() == 2


def test_it_keeps_the_active_policy_an_operator_chose(redis_conn, cp_keys) -> None:
    from controlplane.policies.publishing import publish

    seed()
    publish(RoutingPolicy.objects.create(name="mine", algorithm="least_load"))
    seed()
    assert RoutingPolicy.objects.get(is_active=True).name == "mine"
    assert live_snapshot(redis_conn, cp_keys).policy.name == "mine"


def test_it_fails_clearly_when_redis_is_unreachable(settings) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    redis_client.cache_clear()
    with pytest.raises(CommandError, match="start Redis and run seed_demo again"):
        seed()
    assert Node.objects.count() == 6  # the fleet is saved; the next run publishes it
    assert not PolicyVersion.objects.exists()


def test_it_keeps_the_api_token_in_a_private_file(redis_conn, cp_keys, tmp_path) -> None:
    """`make run`'s banner scrolls away: the token stays in var/api-token (0600), like the password."""
    path = tmp_path / "var" / "api-token"
    out = StringIO()
    call_command("seed_demo", "--token-file", str(path), stdout=out)
    token = Token.objects.get(user__username="operator").key
    assert path.read_text() == token + "\n"
    assert path.stat().st_mode & 0o777 == 0o600
    assert f"TOKEN=$(cat {path})" in out.getvalue()


def test_make_run_keeps_the_token_and_the_readme_says_where_it_is() -> None:
    root = Path(__file__).resolve().parents[2]
    assert "seed_demo --token-file var/api-token" in (root / "Makefile").read_text()
    assert "TOKEN=$(cat var/api-token)" in (root / "scripts" / "banner.sh").read_text()
    readme = (root / "README.md").read_text()
    assert readme.index("TOKEN=$(cat var/api-token)") < readme.index("$TOKEN")
