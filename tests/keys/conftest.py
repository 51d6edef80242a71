"""The client-key tests use the control-plane tests' fixtures (namespace per test, accounts, fleet)."""

from tests.controlplane.conftest import (  # noqa: F401
    anon_client,
    cp_keys,
    fleet,
    operator,
    operator_client,
    redis_conn,
    viewer,
    viewer_client,
)
