"""API permissions: any authenticated user reads; writes need the matching Django permission.

Operators get those permissions through the "operators" group (see the fleet app's migration);
viewers are plain authenticated users. Actions that are not plain writes (publish, rollback, drain)
name the permission they need with ``required_perms`` on the viewset action.
"""

from __future__ import annotations

from rest_framework import permissions


class ViewerReadOperatorWrite(permissions.DjangoModelPermissions):
    """Authenticated users may read; writes follow model permissions or an action's required_perms."""

    perms_map = {
        **permissions.DjangoModelPermissions.perms_map,
        "GET": [],
        "HEAD": [],
        "OPTIONS": [],
    }

    def has_permission(self, request, view) -> bool:
        if not request.user or not request.user.is_authenticated:
            return False
        if request.method in permissions.SAFE_METHODS:
            return True
        action = getattr(view, "action", None)
        handler = getattr(view, action, None) if action else None
        required = getattr(handler, "required_perms", None)
        if required is not None:
            return request.user.has_perms(required)
        if getattr(view, "queryset", None) is None and not hasattr(view, "get_queryset"):
            return request.user.is_staff
        return super().has_permission(request, view)


def required_perms(*perms: str):
    """Mark a viewset action with the permissions it needs (for non-CRUD writes)."""

    def decorate(func):
        func.required_perms = perms
        return func

    return decorate
