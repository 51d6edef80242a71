"""Rename the ``Model`` class to ``LLMModel``; the table keeps its name ``fleet_model``.

Django renames the content type with the model; the permission codenames (``add_model`` ...) are
renamed here so the operators and viewers groups keep the rights they had.
"""

from django.db import migrations


def rename_permissions(apps, schema_editor, old: str = "model", new: str = "llmmodel"):
    permission_model = apps.get_model("auth", "Permission")
    for permission in permission_model.objects.filter(
        content_type__app_label="fleet", codename__endswith=f"_{old}"
    ):
        action = permission.codename.rsplit("_", 1)[0]
        if permission_model.objects.filter(
            content_type=permission.content_type, codename=f"{action}_{new}"
        ).exists():
            continue
        permission.codename = f"{action}_{new}"
        permission.name = f"Can {action} llm model"
        permission.save(update_fields=["codename", "name"])


def restore_permissions(apps, schema_editor):
    rename_permissions(apps, schema_editor, old="llmmodel", new="model")


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("fleet", "0002_operator_and_viewer_groups"),
        # policies/0001 refers to "fleet.model" and must run before the rename: it says so itself
        # (``run_before``), so the fleet's migrations depend on nothing above the fleet.
    ]

    operations = [
        migrations.RenameModel(old_name="Model", new_name="LLMModel"),
        migrations.AlterModelTable(name="llmmodel", table="fleet_model"),
        migrations.RunPython(rename_permissions, restore_permissions),
    ]
