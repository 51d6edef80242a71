"""Project-wide API helpers: one error shape, one validating serializer base, one viewset base."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import transaction
from django.db.models import ProtectedError
from rest_framework import exceptions, serializers, status, viewsets
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from controlplane import audit
from controlplane.deletion import delete_blockers


class ConflictError(exceptions.APIException):
    """The request is valid but conflicts with the current state (e.g. deleting something in use)."""

    status_code = status.HTTP_409_CONFLICT
    default_detail = "The object is in use."
    default_code = "conflict"


class UnavailableError(Exception):
    """A service the control plane needs (Redis) could not do its part; nothing was changed.

    The API answers 503 with ``code``. Apps subclass it (``policies.publishing.PublishError``), so
    this module needs to know none of them.
    """

    code = "unavailable"


def exception_handler(exc, context):
    """DRF's handler, plus Django ValidationErrors from Model.clean() as 400 field errors."""
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        return Response(detail, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, ProtectedError):
        # A protected foreign key the in-use checks did not foresee (or a concurrent insert).
        names = ", ".join(sorted(str(obj) for obj in exc.protected_objects)[:20])
        return Response(
            {"detail": f"Cannot delete: still referenced by {names}.", "code": "conflict"},
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, UnavailableError):
        return Response({"detail": str(exc), "code": exc.code}, status=status.HTTP_503_SERVICE_UNAVAILABLE)
    if isinstance(exc, exceptions.APIException) or exc is not None:
        return drf_exception_handler(exc, context)
    return None


class ValidatedModelSerializer(serializers.ModelSerializer):
    """A ModelSerializer that validates through ``Model.full_clean()``, like the admin does.

    So the API and the admin accept and reject exactly the same objects, with the same field
    errors. Many-to-many values are set after the instance is saved, in one transaction with it,
    so a fleet change is republished once, complete.
    """

    def validate(self, data):
        attrs = dict(data)
        opts = self.Meta.model._meta
        for field in [*opts.local_many_to_many, *opts.related_objects]:
            attrs.pop(field.name, None)
        if self.instance is None:
            instance = self.Meta.model(**attrs)
        else:
            instance = self.instance
            for name, value in attrs.items():
                setattr(instance, name, value)
        instance.full_clean()
        # clean() may normalise values (e.g. a trailing slash): save what it approved.
        return {**data, **{name: getattr(instance, name) for name in attrs}}

    def create(self, validated_data):
        with transaction.atomic():
            return super().create(validated_data)

    def update(self, instance, validated_data):
        with transaction.atomic():
            return super().update(instance, validated_data)


class BaseModelViewSet(viewsets.ModelViewSet):
    """A ModelViewSet that records every change in the audit trail (who, when, what changed) and
    refuses, with 409 and the reason, to delete what routing still uses."""

    def perform_create(self, serializer) -> None:
        super().perform_create(serializer)
        audit.record(self.request.user, serializer.instance, "Created through the API.", added=True)

    def perform_update(self, serializer) -> None:
        # From the database: validation has already set the new values on serializer.instance.
        before = audit.object_state(type(serializer.instance).objects.get(pk=serializer.instance.pk))
        super().perform_update(serializer)
        changes = audit.describe_state_changes(before, audit.object_state(serializer.instance))
        if changes:
            audit.record(self.request.user, serializer.instance, f"Changed through the API: {changes}")

    def perform_destroy(self, instance) -> None:
        reasons = delete_blockers(instance)
        if reasons:
            raise ConflictError(" ".join(reasons))
        with transaction.atomic():
            audit.record(self.request.user, instance, "Deleted through the API.", deleted=True)
            instance.delete()
