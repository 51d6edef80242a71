"""API filters of the fleet: regions, models and nodes (``?region=us-east&state=draining``)."""

from __future__ import annotations

import django_filters
from django.db.models import Q, QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field

from controlplane.fleet.choices import NodeStateChoices
from controlplane.fleet.models import LLMModel, Node, Region


@extend_schema_field(OpenApiTypes.STR)
class SlugsFilter(django_filters.ModelMultipleChoiceFilter):
    """Objects by one or more names of a related object (``?region=us-east&region=eu-central``)."""


class RegionFilterSet(django_filters.FilterSet):
    """Regions by slug, provider or a free-text ``q``."""

    q = django_filters.CharFilter(method="search", label="Search")

    class Meta:
        model = Region
        fields = ["slug", "provider", "zone"]

    def search(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        return queryset.filter(Q(slug__icontains=value) | Q(name__icontains=value))


class LLMModelFilterSet(django_filters.FilterSet):
    """Models by name or a free-text ``q``."""

    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains", label="Search")

    class Meta:
        model = LLMModel
        fields = ["name"]


class NodeFilterSet(django_filters.FilterSet):
    """Nodes by region slug, state, served model name, GPU type or a free-text ``q``."""

    q = django_filters.CharFilter(method="search", label="Search")
    region = SlugsFilter(field_name="region__slug", to_field_name="slug", queryset=Region.objects.all())
    state = django_filters.MultipleChoiceFilter(choices=NodeStateChoices.choices)
    model = SlugsFilter(
        field_name="served_models__name", to_field_name="name", queryset=LLMModel.objects.all()
    )

    class Meta:
        model = Node
        fields = ["name", "region", "state", "model", "gpu_type"]

    def search(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        return queryset.filter(Q(name__icontains=value) | Q(base_url__icontains=value))
