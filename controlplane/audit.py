"""Who changed what, and when: fleet and policy changes made in the dashboard or the REST API.

The audit trail is Django's admin ``LogEntry`` (user, time, object, message): the admin already
writes it for changes made there and shows it as each object's history, so changes made in the
dashboard and the API land in the same place instead of a second log. Publishes and rollbacks are recorded by
``PolicyVersion`` itself (author, note, time).
"""

from __future__ import annotations

from typing import Any

import msgspec
from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.contenttypes.models import ContentType
from django.db import models
from django.db.models import QuerySet

from routing.contract import PARAMS_BY_ALGORITHM

# What an operator reads in the history: the fields a policy edit can change.
POLICY_AUDIT_FIELDS = ("name", "description", "algorithm", "params", "model_scope", "residency", "max_rtt_ms")


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


def effective_params(algorithm: str, params: Any) -> Any:
    """The parameters the gateways would use: stored values plus the contract's defaults.

    So an edit that only spells out a default (or drops one) is not reported as a change.
    """
    struct = PARAMS_BY_ALGORITHM.get(algorithm)
    if struct is None or not isinstance(params, dict):
        return params
    try:
        values = msgspec.to_builtins(msgspec.convert(params, struct))
    except msgspec.ValidationError:
        return params
    values.pop("type", None)  # the union tag: the algorithm field says it already
    return values


def policy_state(policy: Any) -> dict[str, Any]:
    """The audited fields of a policy, as plain values (call before and after an edit)."""
    state = {name: getattr(policy, name) for name in POLICY_AUDIT_FIELDS if name != "model_scope"}
    state["params"] = effective_params(policy.algorithm, policy.params)
    state["model_scope"] = sorted(policy.model_scope.values_list("name", flat=True)) if policy.pk else []
    return state


def object_state(obj: models.Model) -> dict[str, Any]:
    """The audited fields of any object, as plain values (policies: ``policy_state``)."""
    from django.forms.models import model_to_dict

    if hasattr(obj, "params") and hasattr(obj, "algorithm"):
        return policy_state(obj)
    state = model_to_dict(obj)
    for name, value in state.items():
        if isinstance(value, list):
            state[name] = sorted(str(item) for item in value)
    return state


def describe_state_changes(before: dict[str, Any], after: dict[str, Any]) -> str:
    """``state: active -> draining`` for every field that differs (policies: ``describe_changes``)."""
    if "params" in after and "algorithm" in after:
        return describe_changes(before, after)
    return "; ".join(
        f"{name}: {_short(before.get(name))} -> {_short(after.get(name))}"
        for name in sorted(before.keys() | after.keys())
        if before.get(name) != after.get(name)
    )


def describe_changes(before: dict[str, Any], after: dict[str, Any]) -> str:
    """``params.w_rtt: 1.0 -> 2.5; max_rtt_ms: None -> 300.0`` (empty when nothing changed)."""
    parts = []
    for name in POLICY_AUDIT_FIELDS:
        old, new = before.get(name), after.get(name)
        if isinstance(old, dict) or isinstance(new, dict):
            old, new = old or {}, new or {}
            for key in sorted(old.keys() | new.keys()):
                if old.get(key) != new.get(key):
                    parts.append(f"{name}.{key}: {old.get(key)} -> {new.get(key)}")
        elif old != new:
            parts.append(f"{name}: {_short(old)} -> {_short(new)}")
    return "; ".join(parts)


def _short(value: Any) -> str:
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
