"""Create the "operators" and "viewers" groups with the fleet's permissions (see controlplane/accounts.py).

The policies' permissions are granted by policies/0002; this migration once depended on
policies/0001 to grant them here, which made the fleet depend on the app above it.
"""

from django.db import migrations


def create_groups(apps, schema_editor):
    from controlplane.accounts import sync_groups

    sync_groups(apps, ("fleet",))


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("fleet", "0001_initial"),
    ]

    operations = [migrations.RunPython(create_groups, migrations.RunPython.noop)]
