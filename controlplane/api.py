"""Project-wide API helpers: one error shape, one validating serializer base, one viewset base,
strict field types, exact bodies and query strings. Pagination: ``controlplane.pagination``; the
schema: ``controlplane.schema``."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError, OperationalError, models, transaction
from django.db.models import ProtectedError
from rest_framework import exceptions, serializers, status, viewsets
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from controlplane import audit
from controlplane.deletion import delete_blockers

log = logging.getLogger(__name__)


class ConflictError(exceptions.APIException):
    """The request is valid but conflicts with the current state (e.g. deleting something in use)."""

    status_code = status.HTTP_409_CONFLICT
    default_detail = "The object is in use."
    default_code = "conflict"


class ConcurrentWriteError(ConflictError):
    """Another writer changed the same thing at the same moment; nothing of this request was kept."""

    default_detail = "A concurrent change conflicted with this one; nothing was changed. Retry the request."
    default_code = "concurrent_write"


class UnavailableError(Exception):
    """A service the control plane needs (Redis) could not do its part; nothing was changed.

    The API answers 503 with ``code``. Apps subclass it (``policies.publishing.PublishError``), so
    this module needs to know none of them.
    """

    code = "unavailable"
    # What the client is told; ``str(exc)`` (which may name internal hosts) goes to the log only.
    public_detail = "A service the control plane needs is unreachable; nothing was changed. Try again."


# Errors that say "this name is taken": a conflict with the current state (409), not bad input.
UNIQUE_CODES = frozenset({"unique", "unique_together", "unique_constraint"})


def _django_error_codes(exc: DjangoValidationError) -> set[str]:
    errors = [e for errs in exc.error_dict.values() for e in errs] if hasattr(exc, "error_dict") else []
    return {e.code or "invalid" for e in errors} if errors else {exc.code or "invalid"}


def _drf_error_codes(codes) -> set[str]:
    if isinstance(codes, dict):
        return set().union(*(_drf_error_codes(c) for c in codes.values())) if codes else set()
    if isinstance(codes, list):
        return set().union(*(_drf_error_codes(c) for c in codes)) if codes else set()
    return {str(codes)}


def exception_handler(exc, context):
    """DRF's handler, plus Django ValidationErrors from Model.clean() as 400 field errors.

    Validation errors that are all uniqueness ("a region with this slug already exists") answer
    409: the input is well-formed, it conflicts with what exists.
    """
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        conflict = _django_error_codes(exc) <= UNIQUE_CODES
        return Response(detail, status=status.HTTP_409_CONFLICT if conflict else status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, exceptions.ValidationError) and _drf_error_codes(exc.get_codes()) <= UNIQUE_CODES:
        return Response(exc.detail, status=status.HTTP_409_CONFLICT)
    if isinstance(exc, ProtectedError):
        # A protected foreign key the in-use checks did not foresee (or a concurrent insert).
        names = ", ".join(sorted(str(obj) for obj in exc.protected_objects)[:20])
        return Response(
            {"detail": f"Cannot delete: still referenced by {names}.", "code": "conflict"},
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, IntegrityError | OperationalError) and _is_write_conflict(exc):
        # A constraint or lock the validation could not foresee, hit by a concurrent writer: the
        # transaction rolled back, and the same request sent again will see the other's change.
        log.warning("concurrent write conflict: %s", exc)
        return Response(
            {"detail": ConcurrentWriteError.default_detail, "code": ConcurrentWriteError.default_code},
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, UnavailableError):
        # The cause names internal hosts and ports: it goes to the log, not to the client.
        log.warning("%s: %s", exc.code, exc)
        return Response(
            {"detail": exc.public_detail, "code": exc.code}, status=status.HTTP_503_SERVICE_UNAVAILABLE
        )
    if isinstance(exc, exceptions.APIException) or exc is not None:
        return drf_exception_handler(exc, context)
    return None


# PostgreSQL SQLSTATEs of a write that lost to a concurrent one: serialization failure, deadlock.
_CONFLICT_SQLSTATES = frozenset({"40001", "40P01"})


def _is_write_conflict(exc: Exception) -> bool:
    if isinstance(exc, IntegrityError):
        return True
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) in _CONFLICT_SQLSTATES or "database is locked" in str(exc)


class StrictCharField(serializers.CharField):
    """A string, only: ``{"name": 0}`` is a 400, not the name "0". Its length is checked as sent:
    DRF trims whitespace first, so ``"/x" + 600 spaces`` passed a ``maxLength`` of 200 that the
    schema promises (schemathesis ST201)."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        if self.max_length is not None and len(data) > self.max_length:
            self.fail("max_length", max_length=self.max_length)
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer, only (``"5"`` and ``true`` are 400s; ``5.0`` is 5, as JSON Schema has it)."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        if isinstance(data, float) and not data.is_integer():
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictFloatField(serializers.FloatField):
    """A JSON number, only (``"1.5"`` and ``true`` are 400s)."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """``true`` or ``false``, only (``"yes"`` and ``1`` are 400s)."""

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class StrictManyRelatedField(serializers.ManyRelatedField):
    """A JSON list, only (DRF's own takes any iterable: ``{}`` was an empty list)."""

    def to_internal_value(self, data):
        if not isinstance(data, list):
            self.fail("not_a_list", input_type=type(data).__name__)
        return super().to_internal_value(data)


class StrictSlugRelatedField(serializers.SlugRelatedField):
    """An object by its name, given as a string (``[0]`` is a 400, not the model named "0")."""

    @classmethod
    def many_init(cls, *args, **kwargs):
        field = super().many_init(*args, **kwargs)
        field.__class__ = StrictManyRelatedField
        return field

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


STRICT_FIELD_MAPPING = {
    **serializers.ModelSerializer.serializer_field_mapping,
    models.CharField: StrictCharField,
    models.TextField: StrictCharField,
    models.SlugField: StrictCharField,
    models.IntegerField: StrictIntegerField,
    models.SmallIntegerField: StrictIntegerField,
    models.BigIntegerField: StrictIntegerField,
    models.PositiveIntegerField: StrictIntegerField,
    models.PositiveSmallIntegerField: StrictIntegerField,
    models.PositiveBigIntegerField: StrictIntegerField,
    models.FloatField: StrictFloatField,
    models.BooleanField: StrictBooleanField,
}


class ExactSerializerMixin:
    """Refuse a body that names a field the serializer does not take: 400 naming each one.

    DRF drops unknown names silently, so ``{"max_rtt": 100}`` (for ``max_rtt_ms``) answered 200
    and changed nothing. A read-only field is refused the same way, with a message that says so:
    ``{"is_active": true}`` accepted and ignored would look like it had worked.
    """

    def to_internal_value(self, data):
        if isinstance(data, Mapping):
            errors = {}
            for name in data:
                field = self.fields.get(name)
                if field is None:
                    errors[name] = ["Unknown field."]
                elif field.read_only:
                    errors[name] = [READ_ONLY_MESSAGES.get(name, "This field is read-only.")]
            if errors:
                raise exceptions.ValidationError(errors, code="unknown_field")
        return super().to_internal_value(data)


# Read-only fields a client may think it can set, and how it does what it meant.
READ_ONLY_MESSAGES = {"is_active": "Read-only: publishing a policy makes it the active one."}


class ExactSerializer(ExactSerializerMixin, serializers.Serializer):
    """A request body serializer that refuses unknown fields (see ``ExactSerializerMixin``)."""


class ExactQueryParamsMixin:
    """Refuse a query parameter the operation does not document: 400 naming each one.

    DRF ignores what it does not know, so ``?search=x`` or ``?regoin=eu`` answered the whole list
    as if filtered. The parameters an operation takes are the ones its OpenAPI operation lists,
    from the same sources: on a list, the filter backends' and the paginator's; everywhere, the
    view's ``extra_query_params``.
    """

    extra_query_params: tuple[str, ...] = ()

    def initial(self, request, *args, **kwargs) -> None:
        super().initial(request, *args, **kwargs)
        if getattr(self, request.method.lower(), None) is None:
            return  # a method the route does not have: DRF answers 405, which says more
        unknown = sorted(set(request.query_params) - self.documented_query_params())
        if unknown:
            raise exceptions.ValidationError(
                {name: ["Unknown query parameter."] for name in unknown}, code="unknown_parameter"
            )

    def documented_query_params(self) -> set[str]:
        names = set(self.extra_query_params)
        if getattr(self, "action", None) == "list":
            for backend_class in getattr(self, "filter_backends", ()):
                backend = backend_class()
                if hasattr(backend, "get_filterset_class"):  # django-filter's: documented by spectacular
                    filterset = backend.get_filterset_class(self, self.get_queryset())
                    names.update(filterset.base_filters if filterset is not None else ())
                else:
                    names.update(p["name"] for p in backend.get_schema_operation_parameters(self))
            paginator = getattr(self, "paginator", None)
            if paginator is not None:
                names.update(p["name"] for p in paginator.get_schema_operation_parameters(self))
        return names


class ValidatedModelSerializer(ExactSerializerMixin, serializers.ModelSerializer):
    """A ModelSerializer that validates through ``Model.full_clean()``, like the admin does.

    So the API and the admin accept and reject exactly the same objects, with the same field
    errors. Many-to-many values are set after the instance is saved, in one transaction with it,
    so a fleet change is republished once, complete. Field types are strict (``STRICT_FIELD_MAPPING``).
    """

    serializer_field_mapping = STRICT_FIELD_MAPPING

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


class BaseAPIView(ExactQueryParamsMixin, APIView):
    """An APIView that refuses undocumented query parameters."""


class BaseReadOnlyViewSet(ExactQueryParamsMixin, viewsets.ReadOnlyModelViewSet):
    """A ReadOnlyModelViewSet that refuses undocumented query parameters."""


class BaseModelViewSet(ExactQueryParamsMixin, viewsets.ModelViewSet):
    """A ModelViewSet that records every change in the audit trail (who, when, what changed),
    refuses, with 409 and the reason, to delete what routing still uses, and refuses undocumented
    query parameters."""

    def update(self, request, *args, **kwargs):
        # An edit (PUT, PATCH) reads, validates and saves its object under the row's lock. It saves
        # the whole row as it read it: read before the lock, a change another request committed
        # meanwhile (a node drained, a key revoked or rotated) was written back to what it had been.
        with transaction.atomic():
            self._lock_object()
            return super().update(request, *args, **kwargs)

    def _lock_object(self) -> None:
        """Lock the row the URL names until the transaction ends (SQLite: the transaction's
        write lock is already held); nothing when the URL names none (``get_object`` answers 404)."""
        lookup = self.kwargs.get(self.lookup_url_kwarg or self.lookup_field)
        try:
            rows = self.get_queryset().model.objects.select_for_update().filter(**{self.lookup_field: lookup})
            list(rows.values_list("pk", flat=True))
        except (TypeError, ValueError, DjangoValidationError):
            pass

    def perform_create(self, serializer) -> None:
        super().perform_create(serializer)
        audit.record(self.request.user, serializer.instance, "Created through the API.", added=True)

    def perform_update(self, serializer) -> None:
        # From the database: validation has already set the new values on serializer.instance.
        model = type(serializer.instance)
        before = model.objects.get(pk=serializer.instance.pk).audit_state()
        super().perform_update(serializer)
        changes = model.describe_audit_changes(before, serializer.instance.audit_state())
        if changes:
            audit.record(self.request.user, serializer.instance, f"Changed through the API: {changes}")

    def perform_destroy(self, instance) -> None:
        reasons = delete_blockers(instance)
        if reasons:
            raise ConflictError(" ".join(reasons))
        with transaction.atomic():
            audit.record(self.request.user, instance, "Deleted through the API.", deleted=True)
            instance.delete()
