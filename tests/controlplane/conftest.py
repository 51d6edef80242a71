"""Fixtures of the control-plane tests: the shared ones (tests/controlplane/fixtures.py), API clients."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from controlplane.accounts import Account
from tests.controlplane.fixtures import cp_keys, fleet, operator, redis_conn, viewer
from tests.controlplane.support import client_for

__all__ = ["cp_keys", "fleet", "operator", "redis_conn", "viewer"]  # fixtures for this directory


@pytest.fixture
def operator_client(operator: Account) -> APIClient:
    return client_for(operator.token)


@pytest.fixture
def viewer_client(viewer: Account) -> APIClient:
    return client_for(viewer.token)


@pytest.fixture
def anon_client() -> APIClient:
    return client_for(None)
