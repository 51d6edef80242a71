"""Helpers for the control-plane tests: a small fleet, API clients with tokens, Redis read-back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from django.db import connection
from rest_framework.test import APIClient

from controlplane.fleet.models import LLMModel, Node, Region
from routing import contract
from routing.contract import PolicySnapshot, RedisKeys

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
REGIONS = {
    "us-east": ("US East (Ashburn)", 39.04, -77.49),
    "eu-central": ("EU Central (Frankfurt)", 50.11, 8.68),
    "ap-south": ("AP South (Mumbai)", 19.08, 72.88),
}


@dataclass(frozen=True)
class Fleet:
    """Three regions, one model and two nodes per region (ports 9101..9106, nothing listens)."""

    regions: dict[str, Region]
    model: LLMModel
    nodes: dict[str, Node]


def make_regions_and_model() -> tuple[dict[str, Region], LLMModel]:
    """The three demo regions and the demo model (reused when they exist)."""
    regions = {
        slug: Region.objects.get_or_create(
            slug=slug, defaults={"name": name, "latitude": lat, "longitude": lon}
        )[0]
        for slug, (name, lat, lon) in REGIONS.items()
    }
    model, _ = LLMModel.objects.get_or_create(
        name=LLAMA, defaults={"kv_block_size": 16, "max_context_tokens": 32768}
    )
    return regions, model


def make_fleet() -> Fleet:
    regions, model = make_regions_and_model()
    nodes = {}
    port = 9101
    for slug, region in regions.items():
        for index in (1, 2):
            node = Node.objects.create(
                name=f"{slug}-{index}", region=region, base_url=f"http://127.0.0.1:{port}"
            )
            node.served_models.add(model)
            nodes[node.name] = node
            port += 1
    return Fleet(regions=regions, model=model, nodes=nodes)


def client_for(token: str | None) -> APIClient:
    """An API client authenticated with an API token (anonymous for None)."""
    client = APIClient()
    if token is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


def live_snapshot(client: redis.Redis, keys: RedisKeys) -> PolicySnapshot | None:
    """The snapshot the gateways would load, decoded with the contract's structs."""
    raw = client.get(keys.policy_current)
    return None if raw is None else contract.decode(raw, PolicySnapshot)


def edit_racing(
    monkeypatch: pytest.MonkeyPatch,
    serializer_class: type,
    edit: Callable[[], Any],
    meanwhile: Callable[[], Any],
    wait_s: float = 3.0,
) -> tuple[Any, Any]:
    """Run ``edit`` (a PUT or PATCH) and, once it has loaded and validated its object, ``meanwhile``
    in another thread (another database connection); the edit goes on when ``meanwhile`` is done,
    or after ``wait_s`` (``meanwhile`` may have to wait for the edit's lock). Returns both answers.

    PostgreSQL only: SQLite's in-memory test database refuses a second writer instead of waiting.
    """
    if connection.vendor != "postgresql":
        pytest.skip("two connections writing at once: PostgreSQL")
    loaded, done = threading.Event(), threading.Event()
    editor: list[int] = []
    validate = serializer_class.validate

    def validate_then_wait(self, data):
        data = validate(self, data)
        if threading.get_ident() in editor and not loaded.is_set():
            loaded.set()
            done.wait(timeout=wait_s)
        return data

    monkeypatch.setattr(serializer_class, "validate", validate_then_wait)
    answers: dict[str, Any] = {}

    def run(name: str, call: Callable[[], Any], before: threading.Event | None, after: threading.Event):
        if before is None:
            editor.append(threading.get_ident())
        else:
            before.wait(timeout=10)
        try:
            answers[name] = call()
        except BaseException as exc:  # reported by the caller's assertions
            answers[name] = exc
        finally:
            after.set()
            connection.close()

    threads = [
        threading.Thread(target=run, args=("edit", edit, None, loaded)),
        threading.Thread(target=run, args=("meanwhile", meanwhile, loaded, done)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return answers["edit"], answers["meanwhile"]
