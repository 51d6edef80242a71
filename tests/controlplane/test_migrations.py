"""The migrations keep existing databases working: the groups' permissions, and nothing to redo.

Runs ``manage.py migrate`` on a SQLite file of the test's own (real processes, like an operator).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

GROUP_PERMISSIONS = (
    "import json; from django.contrib.auth.models import Group; print(json.dumps({g.name: sorted("
    "g.permissions.values_list('content_type__app_label', 'codename')) for g in Group.objects.all()}))"
)

REVOKE_POLICIES = (
    "from django.contrib.auth.models import Group, Permission\n"
    "for group in Group.objects.all():\n"
    "    group.permissions.remove(*Permission.objects.filter(content_type__app_label='policies'))"
)


def manage(database: Path, *args: str) -> str:
    env = {**os.environ, "DEBUG": "true", "DATABASE_URL": f"sqlite:///{database}"}
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def group_permissions(database: Path) -> dict[str, list[list[str]]]:
    return json.loads(manage(database, "shell", "-c", GROUP_PERMISSIONS).strip().splitlines()[-1])


def test_it_grants_the_policies_permissions_from_the_policies_migrations(tmp_path: Path) -> None:
    database = tmp_path / "existing.sqlite3"
    manage(database, "migrate", "--no-input", "-v", "0")
    complete = group_permissions(database)
    assert ["policies", "publish_routingpolicy"] in complete["operators"]

    # Back to before policies/0002, and without the policies' permissions in the groups: the
    # fleet's migrations no longer grant them, policies/0002 does.
    manage(database, "migrate", "policies", "0001_initial", "--no-input", "-v", "0")
    manage(database, "shell", "-c", REVOKE_POLICIES)
    assert ["policies", "publish_routingpolicy"] not in group_permissions(database)["operators"]
    manage(database, "migrate", "--no-input", "-v", "0")
    assert group_permissions(database) == complete
    assert "No migrations to apply" in manage(database, "migrate", "--no-input")
