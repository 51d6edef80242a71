"""Serializers of the fleet API. Validation is the models' own (``ValidatedModelSerializer``)."""

from __future__ import annotations

from rest_framework import serializers

from controlplane.api import StrictCharField, StrictSlugRelatedField, ValidatedModelSerializer
from controlplane.fleet.models import LLMModel, Node, Region


class RegionSerializer(ValidatedModelSerializer):
    """A region; ``node_count`` is read-only."""

    url = serializers.HyperlinkedIdentityField(view_name="region-detail")
    node_count = serializers.IntegerField(read_only=True, default=0)

    class Meta:
        model = Region
        fields = ["id", "url", "slug", "name", "latitude", "longitude", "provider", "zone", "node_count"]


class LLMModelSerializer(ValidatedModelSerializer):
    """A served model, by the name clients send; ``node_count`` is read-only."""

    url = serializers.HyperlinkedIdentityField(view_name="model-detail")
    node_count = serializers.IntegerField(read_only=True, default=0)

    class Meta:
        model = LLMModel
        fields = [
            "id",
            "url",
            "name",
            "kv_block_size",
            "max_context_tokens",
            "tokenizer_path",
            "chat_template_path",
            "model_folder",
            "lora_adapter",
            "node_count",
        ]


class NodeSerializer(ValidatedModelSerializer):
    """A GPU node: ``region`` by slug and ``models`` by name, both writable."""

    url = serializers.HyperlinkedIdentityField(view_name="node-detail")
    region = StrictSlugRelatedField(slug_field="slug", queryset=Region.objects.all())
    models = StrictSlugRelatedField(
        many=True,
        slug_field="name",
        queryset=LLMModel.objects.all(),
        source="served_models",
        required=False,
        help_text="Names of the models this node serves.",
    )
    labels = serializers.DictField(child=StrictCharField(allow_blank=True), required=False)

    class Meta:
        model = Node
        fields = [
            "id",
            "url",
            "name",
            "region",
            "base_url",
            "models",
            "gpu_type",
            "gpu_count",
            "max_num_seqs",
            "prefill_tokens_per_s",
            "kv_capacity_tokens",
            "state",
            "labels",
            "kv_events_endpoint",
            "kv_events_replay_endpoint",
            "kv_events_topic",
            "created",
            "last_updated",
        ]
