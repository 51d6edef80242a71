"""Create the "operators" and "viewers" groups with their permissions (see fleet/accounts.py)."""

from django.db import migrations


def create_groups(apps, schema_editor):
    from controlplane.fleet.accounts import sync_groups

    sync_groups(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("fleet", "0001_initial"),
        # The groups get the policies' permissions too, publish_routingpolicy among them.
        ("policies", "0001_initial"),
    ]

    operations = [migrations.RunPython(create_groups, migrations.RunPython.noop)]
