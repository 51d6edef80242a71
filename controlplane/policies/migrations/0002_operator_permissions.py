"""Grant the operators and viewers groups the policies' permissions (see controlplane/accounts.py).

fleet/0002 used to grant them, which made the fleet's migrations depend on this app. On a database
that already has them this changes nothing (``sync_groups`` is idempotent).
"""

from django.db import migrations


def grant_permissions(apps, schema_editor):
    from controlplane.accounts import sync_groups

    sync_groups(apps, ("policies",))


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("policies", "0001_initial"),
    ]

    operations = [migrations.RunPython(grant_permissions, migrations.RunPython.noop)]
