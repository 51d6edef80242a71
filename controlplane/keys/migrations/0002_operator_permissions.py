from __future__ import annotations

from django.db import migrations


def grant_operators(apps, schema_editor):
    from controlplane.fleet.accounts import sync_groups

    sync_groups(apps)  # operators manage client keys; viewers may look at them


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0003_rename_model_llmmodel"),
        ("keys", "0001_initial"),
    ]

    operations = [migrations.RunPython(grant_operators, migrations.RunPython.noop)]
