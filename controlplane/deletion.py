"""Why an object cannot be deleted without breaking routing: one answer from every app.

The API (409 with the reasons) and the admin (listed as protected objects) ask ``delete_blockers``,
so both refuse the same deletes with the same words. Each app registers the rules it knows
(``@blocks_deletion``) when it is ready: the fleet's own (a region with nodes), the policies' (a
region in residency rules); core asks them all without importing any of them.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db import models

DeleteBlocker = Callable[[models.Model], list[str]]

_blockers: list[DeleteBlocker] = []


def blocks_deletion(blocker: DeleteBlocker) -> DeleteBlocker:
    """Register ``blocker``: it returns the reasons an object must not be deleted (empty: none)."""
    if blocker not in _blockers:
        _blockers.append(blocker)
    return blocker


def delete_blockers(obj: models.Model) -> list[str]:
    """Human-readable reasons ``obj`` must not be deleted, from every app; empty when it may be."""
    return [reason for blocker in _blockers for reason in blocker(obj)]


def names(queryset: models.QuerySet, field: str) -> str:
    """Up to 20 names from ``queryset``, for a reason's text."""
    return ", ".join(queryset.values_list(field, flat=True)[:20])
