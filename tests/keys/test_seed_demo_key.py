"""``manage.py seed_demo_key``: the demo key of ``make run``, its secret kept in a 0600 file."""

from __future__ import annotations

import ast
import stat
from pathlib import Path

import pytest
from django.core.management import call_command

from controlplane.keys.models import ClientKey, hash_secret
from routing.contract import ClientKeySet, decode

pytestmark = pytest.mark.django_db(transaction=True)

KEYS_DIR = Path(__file__).resolve().parents[2] / "controlplane" / "keys"


def test_it_creates_the_demo_key_once_and_publishes_it(tmp_path, redis_conn, cp_keys):
    path = tmp_path / "demo-key"
    call_command("seed_demo_key", path=str(path))
    secret = path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    call_command("seed_demo_key", path=str(path))  # again: nothing changes
    assert path.read_text().strip() == secret
    assert ClientKey.objects.get().secret_sha256 == hash_secret(secret)
    published = decode(redis_conn.get(cp_keys.key_set), ClientKeySet)
    assert [key.secret_sha256 for key in published.keys] == [hash_secret(secret)]


def test_it_replaces_a_revoked_demo_key(tmp_path, redis_conn, cp_keys):
    path = tmp_path / "demo-key"
    call_command("seed_demo_key", path=str(path))
    ClientKey.objects.get().revoke()
    call_command("seed_demo_key", path=str(path))
    assert ClientKey.objects.filter(revoked=False).get().secret_sha256 == hash_secret(
        path.read_text().strip()
    )


def test_keys_never_import_policies():
    imports = []
    for path in KEYS_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imports.append(node.module)
            elif isinstance(node, ast.Import):
                imports += [alias.name for alias in node.names]
    assert not [name for name in imports if name.startswith(("controlplane.policies", "telemetry"))]
