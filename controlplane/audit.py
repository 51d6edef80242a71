"""Who changed what, and when: fleet and policy changes made in the dashboard or the REST API.

The audit trail is Django's admin ``LogEntry`` (user, time, object, message): the admin already
writes it for changes made there and shows it as each object's history, so changes made in the
dashboard and the API land in the same place instead of a second log. Publishes and rollbacks are recorded by
``PolicyVersion`` itself (author, note, time). Each audited model says what its state is
(``Audited.audit_state``) and how a change of it reads (``Audited.describe_audit_changes``).
"""

from __future__ import annotations

from typing import Any

from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.contenttypes.models import ContentType
from django.db import models
from django.db.models import QuerySet


def record(
    user: AbstractBaseUser, obj: models.Model, message: str, *, added: bool = False, deleted: bool = False
) -> LogEntry:
    """Append one entry to the audit trail (call before deleting ``obj``)."""
    return LogEntry.objects.log_actions(
        user_id=user.pk,
        queryset=[obj],
        action_flag=ADDITION if added else DELETION if deleted else CHANGE,
        change_message=message,
        single_object=True,
    )


class Audited:
    """Mixin of every model whose edits the audit trail records: the model says what its state is
    and how a change of it reads. The defaults take every field and compare them one by one; a
    model whose fields need reading (``RoutingPolicy``: parameters with their defaults) overrides.
    """

    def audit_state(self) -> dict[str, Any]:
        """The audited fields, as plain values (call before and after an edit)."""
        from django.forms.models import model_to_dict

        state = model_to_dict(self)
        for name, value in state.items():
            if isinstance(value, list):
                state[name] = sorted(str(item) for item in value)
        return state

    @classmethod
    def describe_audit_changes(cls, before: dict[str, Any], after: dict[str, Any]) -> str:
        """``state: active -> draining`` for every field that differs (empty when nothing did)."""
        return "; ".join(
            f"{name}: {short(before.get(name))} -> {short(after.get(name))}"
            for name in sorted(before.keys() | after.keys())
            if before.get(name) != after.get(name)
        )


def short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def recent(*model_classes: type[models.Model], limit: int = 8) -> QuerySet[LogEntry]:
    """The latest audit entries about objects of these models (from the dashboard or the admin)."""
    content_types = ContentType.objects.get_for_models(*model_classes).values()
    return (
        LogEntry.objects.filter(content_type__in=content_types)
        .select_related("user", "content_type")
        .order_by("-action_time")[:limit]
    )


def recent_for(obj: models.Model, limit: int = 10) -> QuerySet[LogEntry]:
    """The latest audit entries about one object."""
    return (
        LogEntry.objects.filter(
            content_type=ContentType.objects.get_for_model(obj, for_concrete_model=False),
            object_id=str(obj.pk),
        )
        .select_related("user")
        .order_by("-action_time")[:limit]
    )


SYSTEM_USERNAME = "gorgo-system"


def system_user() -> AbstractBaseUser:
    """The account automatic actions (a canary's automatic rollback) are recorded under.

    Django's audit log needs a user on every entry; this one cannot sign in (inactive, no usable
    password), so the history says "gorgo-system" where no person acted.
    """
    from django.contrib.auth import get_user_model

    user, created = get_user_model().objects.get_or_create(
        username=SYSTEM_USERNAME, defaults={"is_active": False}
    )
    if created:
        user.set_unusable_password()
        user.save(update_fields=["password"])
    return user
