from __future__ import annotations

import django_filters

from controlplane.keys.models import ClientKey


class ClientKeyFilterSet(django_filters.FilterSet):
    class Meta:
        model = ClientKey
        fields = ["key_id", "owner", "team", "priority", "revoked"]
