"""API filters of the telemetry app: time ranges, nodes, regions, bucket resolution.

Bad values are a 400 naming the parameter (django-filter's form errors through DRF):
``since``/``until`` take ISO 8601 (``2026-01-01T12:00:00Z``) or unix seconds, and ``since`` must
not be after ``until``; ``node`` is a node id, ``region`` a region slug, ``resolution`` ``10s`` or
``1m``.
"""

from __future__ import annotations

from datetime import UTC, datetime

import django_filters
from django import forms
from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import extend_schema_field

from controlplane.filters import IdFilter, NamesFilter, StrictFilterSet
from controlplane.keys.choices import PriorityChoices
from telemetry.choices import ResolutionChoices, ScopeChoices
from telemetry.models import (
    HealthEvent,
    KeyUsageAggregate,
    MetricSample,
    ProcessedRequestEntry,
    RequestAggregate,
    RTTSample,
)

TIME_HELP = "ISO 8601 date-time (e.g. 2026-01-01T12:00:00Z) or unix seconds."


class TimestampField(forms.Field):
    """A point in time given as ISO 8601 or unix seconds; naive ISO times are taken as UTC."""

    default_error_messages = {"invalid": f"Enter an {TIME_HELP}"}

    def to_python(self, value):
        if value in self.empty_values:
            return None
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            pass
        else:
            if seconds < 0:
                raise forms.ValidationError(self.error_messages["invalid"], code="invalid")
            try:
                return datetime.fromtimestamp(seconds, tz=UTC)
            except (OverflowError, OSError, ValueError):
                raise forms.ValidationError(self.error_messages["invalid"], code="invalid") from None
        try:
            parsed = parse_datetime(text.replace(" ", "+"))  # "+00:00" arrives as " 00:00" in a query
        except ValueError:
            parsed = None
        if parsed is None:
            raise forms.ValidationError(self.error_messages["invalid"], code="invalid")
        return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


@extend_schema_field({"oneOf": [{"type": "string", "format": "date-time"}, {"type": "number", "minimum": 0}]})
class TimestampFilter(django_filters.Filter):
    field_class = TimestampField


class TimeRangeForm(forms.Form):
    """Rejects an empty range (``since`` after ``until``)."""

    def clean(self):
        cleaned = super().clean()
        since, until = cleaned.get("since"), cleaned.get("until")
        if since and until and since > until:
            self.add_error("until", "until must not be earlier than since.")
        return cleaned


class TimeRangeFilterSet(StrictFilterSet):
    """Base: ``since`` (inclusive) and ``until`` (exclusive) over the model's ``ts``."""

    since = TimestampFilter(
        field_name="ts", lookup_expr="gte", label=f"From this time on (inclusive). {TIME_HELP}"
    )
    until = TimestampFilter(
        field_name="ts", lookup_expr="lt", label=f"Before this time (exclusive). {TIME_HELP}"
    )
    node = IdFilter(field_name="node_id", label="Node id.")


class RTTSampleFilterSet(TimeRangeFilterSet):
    region = NamesFilter(field_name="region__slug", label="Probing region (slug).")

    class Meta:
        model = RTTSample
        fields = ["ok"]
        form = TimeRangeForm


class MetricSampleFilterSet(TimeRangeFilterSet):
    region = NamesFilter(field_name="node__region__slug", label="Node region (slug).")

    class Meta:
        model = MetricSample
        fields = ["ok"]
        form = TimeRangeForm


class HealthEventFilterSet(TimeRangeFilterSet):
    region = NamesFilter(field_name="node__region__slug", label="Node region (slug).")

    class Meta:
        model = HealthEvent
        fields = ["current", "source"]
        form = TimeRangeForm


class RequestAggregateFilterSet(TimeRangeFilterSet):
    """``node`` selects per-node buckets, ``region`` per-gateway-region buckets."""

    since = TimestampFilter(
        field_name="bucket_start", lookup_expr="gte", label=f"Buckets starting at or after. {TIME_HELP}"
    )
    until = TimestampFilter(
        field_name="bucket_start", lookup_expr="lt", label=f"Buckets starting before. {TIME_HELP}"
    )
    resolution = django_filters.ChoiceFilter(
        choices=ResolutionChoices.choices, label="Bucket width: 10s or 1m."
    )
    scope = django_filters.ChoiceFilter(choices=ScopeChoices.choices, label="node or region.")
    region = NamesFilter(field_name="region__slug", label="Gateway region (slug).")

    class Meta:
        model = RequestAggregate
        fields: list[str] = []
        form = TimeRangeForm


class KeyUsageFilterSet(StrictFilterSet):
    """Buckets of one key (``key``: its public id, also of a deleted key), of a team, of a priority class."""

    since = TimestampFilter(
        field_name="bucket_start", lookup_expr="gte", label=f"Buckets starting at or after. {TIME_HELP}"
    )
    until = TimestampFilter(
        field_name="bucket_start", lookup_expr="lt", label=f"Buckets starting before. {TIME_HELP}"
    )
    resolution = django_filters.ChoiceFilter(
        choices=ResolutionChoices.choices, label="Bucket width: 10s or 1m."
    )
    key = django_filters.CharFilter(
        field_name="key_id", max_length=16, label="Client key id (the public id, e.g. 3f9a1c2e)."
    )
    team = django_filters.CharFilter(field_name="team", max_length=100, label="The keys' team (exact).")
    priority = django_filters.ChoiceFilter(choices=PriorityChoices.choices, label="Priority class.")

    class Meta:
        model = KeyUsageAggregate
        fields: list[str] = []
        form = TimeRangeForm


class RequestLogFilterSet(StrictFilterSet):
    request_id = django_filters.CharFilter(help_text="The x-request-id a gateway answered with.")

    class Meta:
        model = ProcessedRequestEntry
        fields = ["request_id"]
