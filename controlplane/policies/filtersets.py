"""API filters of routing policies and their published versions."""

from __future__ import annotations

import django_filters
from django.db.models import Q, QuerySet

from controlplane.policies.choices import AlgorithmChoices
from controlplane.policies.models import PolicyVersion, RoutingPolicy


class RoutingPolicyFilterSet(django_filters.FilterSet):
    """Policies by name, algorithm, whether active, or a free-text ``q``."""

    q = django_filters.CharFilter(method="search", label="Search")
    algorithm = django_filters.MultipleChoiceFilter(choices=AlgorithmChoices.choices)

    class Meta:
        model = RoutingPolicy
        fields = ["name", "algorithm", "is_active"]

    def search(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        return queryset.filter(Q(name__icontains=value) | Q(description__icontains=value))


class PolicyVersionFilterSet(django_filters.FilterSet):
    """Versions by policy (id or name), number, author, or a range of numbers."""

    policy_name = django_filters.CharFilter(field_name="policy__name")
    number__gte = django_filters.NumberFilter(field_name="number", lookup_expr="gte")
    number__lte = django_filters.NumberFilter(field_name="number", lookup_expr="lte")

    class Meta:
        model = PolicyVersion
        fields = ["policy", "policy_name", "number", "author_name", "checksum"]
