"""Operator and viewer accounts: the two groups, and creating an account with its API token.

Operators may change the fleet and the policies and publish; viewers may only look. Any
authenticated user may read the API (``controlplane.permissions``); the viewers' group carries the
view permissions the Django admin needs. Both kinds are staff, so both can use the admin.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from django.apps import apps as global_apps
from django.apps.registry import Apps
from django.contrib.auth import get_user_model, password_validation
from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.management import create_permissions
from django.db import transaction

OPERATORS = "operators"
VIEWERS = "viewers"
# Apps whose every permission operators get (add/change/delete/view and policies' publish). Labels,
# not imports: core names the apps but does not depend on them. Each app's own migration grants
# its permissions (``sync_groups(apps, ("policies",))``); a new app adds its label here too.
OPERATOR_APPS = ("fleet", "policies", "keys")


def sync_groups(apps: Apps = global_apps, labels: tuple[str, ...] = OPERATOR_APPS) -> None:
    """Create both groups and grant them the permissions of ``labels``' apps. Idempotent.

    Safe inside a migration: permissions are normally created after ``migrate`` (post_migrate); a
    data migration runs before that, so they are created here first. Permissions an admin added by
    hand stay. Apps not yet in ``apps`` (an older migration state) are skipped; their own
    migration grants them later.
    """
    for label in labels:
        try:
            app_config = apps.get_app_config(label)
        except LookupError:
            continue
        # Historical app configs have no models module, which makes create_permissions skip them.
        had_module = getattr(app_config, "models_module", None)
        app_config.models_module = had_module or True
        try:
            create_permissions(app_config, verbosity=0, apps=apps)
        finally:
            app_config.models_module = had_module
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    operator_perms = Permission.objects.filter(content_type__app_label__in=labels)
    operators, _ = Group.objects.get_or_create(name=OPERATORS)
    operators.permissions.add(*operator_perms)
    viewers, _ = Group.objects.get_or_create(name=VIEWERS)
    viewers.permissions.add(*operator_perms.filter(codename__startswith="view_"))


@dataclass(frozen=True, slots=True)
class Account:
    """What ``ensure_account`` did: the user, their API token, and a password it generated."""

    user: AbstractBaseUser
    token: str
    created: bool
    generated_password: str | None


def ensure_account(username: str, *, password: str | None = None, viewer: bool = False) -> Account:
    """Create or update an operator (or viewer) account and its API token. Idempotent.

    ``password`` replaces the current one; without it a new account gets a generated password
    (returned once) and an existing account keeps its own. Raises ``django.core.exceptions.
    ValidationError`` when the password is too weak.
    """
    from rest_framework.authtoken.models import Token

    User = get_user_model()
    Group = global_apps.get_model("auth", "Group")
    with transaction.atomic():
        sync_groups()
        user, created = User.objects.get_or_create(username=username, defaults={"is_staff": True})
        generated = None
        if password is None and (created or not user.has_usable_password()):
            password = generated = secrets.token_urlsafe(12)
        changed = created
        if password is not None and not user.check_password(password):
            password_validation.validate_password(password, user)
            user.set_password(password)
            changed = True
        if not user.is_staff or not user.is_active:
            user.is_staff = user.is_active = True
            changed = True
        if changed:
            user.save()
        join, leave = (VIEWERS, OPERATORS) if viewer else (OPERATORS, VIEWERS)
        user.groups.add(Group.objects.get(name=join))
        user.groups.remove(Group.objects.get(name=leave))
        token, _ = Token.objects.get_or_create(user=user)
    return Account(user=user, token=token.key, created=created, generated_password=generated)
