"""Filters every API app uses: by id and by names, where an unknown value matches nothing.

django-filter's model-choice filters answer 400 for an id or slug that does not exist; for a
filter that is a valid question ("nodes in region mars?") whose answer is "none", so these
return an empty page instead. Malformed values (``?node=abc``) are still 400s.
"""

from __future__ import annotations

import django_filters
import django_filters.rest_framework
from django import forms
from django.db import models
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field

MAX_ID = 2**63 - 1


@extend_schema_field({"type": "integer", "minimum": 1, "maximum": MAX_ID})
class IdFilter(django_filters.NumberFilter):
    """An object id (1 .. 2^63-1: larger numbers would overflow the database)."""

    field_class = forms.IntegerField

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("min_value", 1)
        kwargs.setdefault("max_value", MAX_ID)
        super().__init__(*args, **kwargs)


class _NamesField(forms.Field):
    widget = forms.SelectMultiple  # reads every value of a repeated parameter

    def to_python(self, value) -> list[str]:
        return [str(item) for item in value or [] if str(item)]


@extend_schema_field(OpenApiTypes.STR)
class NamesFilter(django_filters.Filter):
    """Objects whose ``field_name`` is any of the given names (``?region=us-east&region=eu-central``)."""

    field_class = _NamesField

    def filter(self, qs: QuerySet, value: list[str]) -> QuerySet:
        if not value:
            return qs
        return qs.filter(**{f"{self.field_name}__in": value}).distinct()


class _StrictBooleanField(forms.Field):
    default_error_messages = {"invalid": "Use true or false."}

    def to_python(self, value) -> bool | None:
        if value in (None, ""):
            return None
        if value in ("true", "True"):
            return True
        if value in ("false", "False"):
            return False
        raise forms.ValidationError(self.error_messages["invalid"], code="invalid")


class StrictBooleanFilter(django_filters.BooleanFilter):
    """``true`` or ``false`` (django-filter's own also takes "null", "unknown", "2", ...)."""

    field_class = _StrictBooleanField


class StrictFilterSet(django_filters.rest_framework.FilterSet):
    """The base of every API filterset: typed parameters must hold a value of their type.

    ``?until=`` or ``?ok=`` (present, empty) is a 400, not "no filter": an empty string is not a
    time, a boolean or an id, and a client that sends one has a bug worth hearing about. Text
    filters (names, search) may be empty.
    """

    FILTER_DEFAULTS = {
        **django_filters.rest_framework.FilterSet.FILTER_DEFAULTS,
        models.BooleanField: {"filter_class": StrictBooleanFilter},
    }

    def is_valid(self) -> bool:
        valid = super().is_valid()
        for name, filter_ in self.filters.items():
            if isinstance(filter_, django_filters.CharFilter | NamesFilter) or name not in self.data:
                continue
            values = self.data.getlist(name) if hasattr(self.data, "getlist") else [self.data.get(name)]
            if any(value == "" for value in values):
                self.form.add_error(name, "Give a value, or leave the parameter out.")
                valid = False
        return valid


class FilterBackend(django_filters.rest_framework.DjangoFilterBackend):
    """The API's filter backend: filtersets made from ``filterset_fields`` are strict too."""

    filterset_base = StrictFilterSet
