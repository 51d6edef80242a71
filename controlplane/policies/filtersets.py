"""API filters of routing policies and their published versions."""

from __future__ import annotations

import django_filters
from django.db.models import Q, QuerySet

from controlplane.filters import IdFilter, StrictFilterSet
from controlplane.policies.choices import AlgorithmChoices, ExperimentKindChoices, ExperimentStatusChoices
from controlplane.policies.models import PolicyExperiment, PolicyVersion, RoutingPolicy


class RoutingPolicyFilterSet(StrictFilterSet):
    """Policies by name, algorithm, whether active, or a free-text ``q``."""

    q = django_filters.CharFilter(method="search", label="Search")
    algorithm = django_filters.MultipleChoiceFilter(choices=AlgorithmChoices.choices)

    class Meta:
        model = RoutingPolicy
        fields = ["name", "algorithm", "is_active"]

    def search(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        return queryset.filter(Q(name__icontains=value) | Q(description__icontains=value))


class PolicyVersionFilterSet(StrictFilterSet):
    """Versions by policy (id or name), number, author, or a range of numbers."""

    policy = IdFilter(field_name="policy_id", label="Policy id.")
    policy_name = django_filters.CharFilter(field_name="policy__name")
    number = IdFilter(field_name="number")
    number__gte = IdFilter(field_name="number", lookup_expr="gte")
    number__lte = IdFilter(field_name="number", lookup_expr="lte")

    class Meta:
        model = PolicyVersion
        fields = ["policy", "policy_name", "number", "author_name", "checksum"]


class PolicyExperimentFilterSet(StrictFilterSet):
    """Shadows and canaries by kind, status or policy id."""

    kind = django_filters.ChoiceFilter(choices=ExperimentKindChoices.choices)
    status = django_filters.ChoiceFilter(choices=ExperimentStatusChoices.choices)
    policy = IdFilter(field_name="policy_id", label="Policy id.")

    class Meta:
        model = PolicyExperiment
        fields = ["kind", "status", "policy"]
