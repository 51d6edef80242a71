"""API filters of the fleet: regions, models and nodes (``?region=us-east&state=draining``)."""

from __future__ import annotations

import django_filters
from django.db.models import Q, QuerySet

from controlplane.filters import NamesFilter, StrictFilterSet
from controlplane.fleet.choices import NodeStateChoices
from controlplane.fleet.models import LLMModel, Node, Region


class RegionFilterSet(StrictFilterSet):
    """Regions by slug, provider or a free-text ``q``."""

    q = django_filters.CharFilter(method="search", label="Search")

    class Meta:
        model = Region
        fields = ["slug", "provider", "zone"]

    def search(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        return queryset.filter(Q(slug__icontains=value) | Q(name__icontains=value))


class LLMModelFilterSet(StrictFilterSet):
    """Models by name or a free-text ``q``."""

    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains", label="Search")

    class Meta:
        model = LLMModel
        fields = ["name"]


class NodeFilterSet(StrictFilterSet):
    """Nodes by region slug, state, served model name, GPU type or a free-text ``q``."""

    q = django_filters.CharFilter(method="search", label="Search")
    region = NamesFilter(field_name="region__slug")
    state = django_filters.MultipleChoiceFilter(choices=NodeStateChoices.choices)
    model = NamesFilter(field_name="served_models__name")

    class Meta:
        model = Node
        fields = ["name", "region", "state", "model", "gpu_type"]

    def search(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        return queryset.filter(Q(name__icontains=value) | Q(base_url__icontains=value))
