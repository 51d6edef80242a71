"""Fixtures of the dashboard tests: the control plane's shared ones, logged-in browsers, a policy."""

from __future__ import annotations

import pytest
from django.test import Client

from controlplane.accounts import Account
from controlplane.policies.models import RoutingPolicy
from tests.controlplane.fixtures import cp_keys, fleet, operator, redis_conn, viewer
from tests.controlplane.support import LLAMA, Fleet

# Fixtures for this directory, and what the dashboard tests import from here.
__all__ = ["LLAMA", "Fleet", "cp_keys", "fleet", "operator", "redis_conn", "viewer"]


@pytest.fixture
def operator_client(operator: Account) -> Client:
    client = Client()
    client.force_login(operator.user)
    return client


@pytest.fixture
def viewer_client(viewer: Account) -> Client:
    client = Client()
    client.force_login(viewer.user)
    return client


@pytest.fixture
def policy(fleet: Fleet) -> RoutingPolicy:
    return RoutingPolicy.objects.create(name="default", algorithm="gorgo", params={"w_rtt": 1.0})
