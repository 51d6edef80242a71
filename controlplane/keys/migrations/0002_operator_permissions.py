"""Grant the operators and viewers groups the client keys' permissions (see controlplane/accounts.py)."""

from __future__ import annotations

from django.db import migrations


def grant_permissions(apps, schema_editor):
    from controlplane.accounts import sync_groups

    sync_groups(apps, ("keys",))  # operators manage client keys; viewers may look at them


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("keys", "0001_initial"),
    ]

    operations = [migrations.RunPython(grant_permissions, migrations.RunPython.noop)]
