"""Serializers of the client-key API. The secret appears only in the answer that creates it."""

from __future__ import annotations

from rest_framework import serializers

from controlplane.api import StrictSlugRelatedField, ValidatedModelSerializer
from controlplane.fleet.models import LLMModel, Region
from controlplane.keys.models import ClientKey


class ClientKeySerializer(ValidatedModelSerializer):
    """A client key: ``models`` by name and ``regions`` by slug (empty: all); never its secret."""

    url = serializers.HyperlinkedIdentityField(view_name="client-key-detail")
    models = StrictSlugRelatedField(
        many=True,
        slug_field="name",
        queryset=LLMModel.objects.all(),
        source="allowed_models",
        required=False,
        help_text="Models the key may use; empty: every model.",
    )
    regions = StrictSlugRelatedField(
        many=True,
        slug_field="slug",
        queryset=Region.objects.all(),
        source="allowed_regions",
        required=False,
        help_text="Gateway regions the key may be used in; empty: every region.",
    )
    prefix = serializers.CharField(read_only=True, help_text="How the key's secret starts (not secret).")

    class Meta:
        model = ClientKey
        fields = [
            "id",
            "url",
            "key_id",
            "prefix",
            "name",
            "owner",
            "team",
            "models",
            "regions",
            "requests_per_min",
            "tokens_per_min",
            "max_concurrent",
            "priority",
            "expires_at",
            "revoked",
            "revoked_at",
            "last_used_at",
            "created",
            "last_updated",
        ]
        read_only_fields = ["revoked", "revoked_at", "last_used_at", "created", "last_updated"]


class ClientKeyWithSecretSerializer(ClientKeySerializer):
    """The answer to create and rotate: the key plus its secret, shown this once."""

    secret = serializers.CharField(read_only=True, help_text="Shown only now; store it safely.")

    class Meta(ClientKeySerializer.Meta):
        fields = [*ClientKeySerializer.Meta.fields, "secret"]
