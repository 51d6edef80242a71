from __future__ import annotations

from controlplane.filters import StrictFilterSet
from controlplane.keys.models import ClientKey


class ClientKeyFilterSet(StrictFilterSet):
    class Meta:
        model = ClientKey
        fields = ["key_id", "owner", "team", "priority", "revoked"]
