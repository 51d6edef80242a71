"""Serializers of the policies API: policies, versions, and the bodies of the publish actions."""

from __future__ import annotations

import msgspec
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.exceptions import NotFound

from controlplane.api import (
    ExactSerializer,
    StrictCharField,
    StrictFloatField,
    StrictIntegerField,
    StrictSlugRelatedField,
    ValidatedModelSerializer,
)
from controlplane.fleet.models import LLMModel
from controlplane.policies import experiments, whatif
from controlplane.policies.choices import ExperimentKindChoices
from controlplane.policies.models import PolicyExperiment, PolicyVersion, RoutingPolicy
from routing.contract import MAX_CANARY_SHARE


class ResidencyRuleSerializer(ExactSerializer):
    """Clients in ``client_region`` may only be served by nodes in ``node_regions``."""

    client_region = StrictCharField(max_length=64)
    node_regions = serializers.ListField(child=StrictCharField(max_length=64), allow_empty=False)


class RoutingPolicySerializer(ValidatedModelSerializer):
    """A routing policy. ``params`` are checked against the algorithm; unknown names are errors."""

    url = serializers.HyperlinkedIdentityField(view_name="policy-detail")
    model_scope = StrictSlugRelatedField(
        many=True,
        slug_field="name",
        queryset=LLMModel.objects.all(),
        required=False,
        help_text="Model names this policy serves; empty means every model of the fleet.",
    )
    # Required on create and on PUT: a PUT without it used to reset the policy's parameters.
    params = serializers.DictField(
        help_text="Algorithm parameters ({} for every default); unknown names are errors."
    )
    residency = serializers.ListField(child=ResidencyRuleSerializer(), required=False)
    live_version = serializers.SerializerMethodField(
        help_text="The version number the gateways run, when this is the active policy."
    )

    class Meta:
        model = RoutingPolicy
        fields = [
            "id",
            "url",
            "name",
            "description",
            "algorithm",
            "params",
            "model_scope",
            "residency",
            "max_rtt_ms",
            "auto_tune",
            "is_active",
            "live_version",
            "created",
            "last_updated",
        ]

    @extend_schema_field(serializers.IntegerField(allow_null=True))
    def get_live_version(self, policy: RoutingPolicy) -> int | None:
        # The active policy's newest version is the newest of all: every publish activates its policy.
        return getattr(policy, "latest_version_number", None) if policy.is_active else None


class NestedRoutingPolicySerializer(serializers.ModelSerializer):
    url = serializers.HyperlinkedIdentityField(view_name="policy-detail")

    class Meta:
        model = RoutingPolicy
        fields = ["id", "url", "name"]


class PolicyVersionSerializer(serializers.ModelSerializer):
    """A published, immutable snapshot of a policy with the fleet."""

    url = serializers.HyperlinkedIdentityField(view_name="policyversion-detail")
    policy = NestedRoutingPolicySerializer(read_only=True)
    rolled_back_from = serializers.IntegerField(
        source="rolled_back_from.number",
        read_only=True,
        allow_null=True,
        help_text="The version number this one restored, for a rollback.",
    )
    snapshot = serializers.SerializerMethodField(help_text="The PolicySnapshot as published.")

    class Meta:
        model = PolicyVersion
        fields = [
            "id",
            "url",
            "number",
            "policy",
            "checksum",
            "author_name",
            "note",
            "rolled_back_from",
            "created",
            "published_at",
            "snapshot",
        ]

    @extend_schema_field(OpenApiTypes.OBJECT)
    def get_snapshot(self, version: PolicyVersion) -> dict:
        return msgspec.json.decode(version.snapshot)


class PublishRequestSerializer(ExactSerializer):
    note = StrictCharField(max_length=500, required=False, allow_blank=True, default="")
    checksum = StrictCharField(
        max_length=64,
        required=False,
        help_text="Publish only if the policy still compiles to this checksum (from validate or diff); "
        "409 when the policy or the fleet changed since it was reviewed.",
    )


class RollbackRequestSerializer(ExactSerializer):
    version = StrictIntegerField(
        min_value=1, max_value=2**31 - 1, help_text="Number of an earlier version of this policy."
    )
    note = StrictCharField(max_length=500, required=False, allow_blank=True, default="")

    def validate_version(self, number: int) -> PolicyVersion:
        policy = self.context["policy"]
        version = PolicyVersion.objects.filter(policy=policy, number=number).first()
        if version is None:
            raise NotFound(f"Version {number} is not a version of policy {policy.name}.")
        return version


class SnapshotNodeCountsSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    active = serializers.IntegerField()
    draining = serializers.IntegerField()
    disabled = serializers.IntegerField()


class SnapshotSummarySerializer(serializers.Serializer):
    policy = serializers.CharField()
    algorithm = serializers.CharField()
    params = serializers.DictField(help_text="With every default filled in.")
    model_scope = serializers.ListField(child=serializers.CharField())
    residency = ResidencyRuleSerializer(many=True)
    max_rtt_ms = serializers.FloatField(allow_null=True)
    regions = serializers.ListField(child=serializers.CharField())
    models = serializers.ListField(child=serializers.CharField())
    nodes = SnapshotNodeCountsSerializer()
    routable_nodes = serializers.ListField(
        child=serializers.CharField(), help_text="Active nodes serving a model in scope."
    )


class PolicyValidationSerializer(serializers.Serializer):
    """The answer of a dry run: the policy compiles; what it would publish."""

    valid = serializers.BooleanField()
    checksum = serializers.CharField()
    live_version = serializers.IntegerField(allow_null=True)
    differs_from_live = serializers.BooleanField()
    summary = SnapshotSummarySerializer()


class SnapshotChangeSerializer(serializers.Serializer):
    path = serializers.CharField(help_text="e.g. policy.params.w_rtt or nodes[us-east-1].state")
    old = serializers.JSONField(allow_null=True)
    new = serializers.JSONField(allow_null=True)


class PolicyDiffSerializer(serializers.Serializer):
    """The policy compiled now, against the live snapshot."""

    live_version = serializers.IntegerField(allow_null=True)
    live_policy = serializers.CharField(allow_null=True)
    live_checksum = serializers.CharField(allow_null=True)
    checksum = serializers.CharField()
    changed = serializers.BooleanField()
    changes = SnapshotChangeSerializer(many=True)


class WhatIfRequestSerializer(ExactSerializer):
    minutes = StrictIntegerField(
        min_value=whatif.MIN_MINUTES,
        max_value=whatif.MAX_MINUTES,
        required=False,
        default=whatif.DEFAULT_MINUTES,
        help_text="Replay the request log's last this many minutes.",
    )


class TTFTDistributionSerializer(serializers.Serializer):
    count = serializers.IntegerField()
    p50_ms = serializers.FloatField(allow_null=True)
    p90_ms = serializers.FloatField(allow_null=True)
    p99_ms = serializers.FloatField(allow_null=True)
    mean_ms = serializers.FloatField(allow_null=True)
    cdf = serializers.ListField(
        child=serializers.ListField(child=serializers.FloatField()),
        help_text="[ttft_ms, share of requests at or below it] pairs.",
    )
    histogram = serializers.ListField(
        child=serializers.IntegerField(), help_text="Counts on the result's histogram_edges_ms."
    )
    cross_region_share = serializers.FloatField(allow_null=True)
    unroutable = serializers.IntegerField(help_text="No eligible node under this policy.")
    unfinished = serializers.IntegerField(help_text="Routed, but no first token before the replay ended.")


class WhatIfResultSerializer(serializers.Serializer):
    policy_id = serializers.IntegerField()
    policy_name = serializers.CharField()
    live_version = serializers.IntegerField()
    live_policy = serializers.CharField()
    minutes = serializers.IntegerField()
    since = serializers.FloatField(help_text="Unix seconds of the first replayed arrival.")
    until = serializers.FloatField()
    requests = serializers.IntegerField(help_text="Requests replayed.")
    truncated = serializers.BooleanField(help_text="The window held more; the newest were replayed.")
    with_prefix_hashes = serializers.FloatField(
        help_text="Share of the records with prefix hashes (without them every prompt counts as unique)."
    )
    measured = TTFTDistributionSerializer(help_text="What the window's requests really had.")
    live = TTFTDistributionSerializer(help_text="The live policy, replayed.")
    draft = TTFTDistributionSerializer(help_text="This policy as it is now, replayed.")
    histogram_edges_ms = serializers.ListField(child=serializers.FloatField())
    replay_s = serializers.FloatField(help_text="Wall time of both replays.")


class WhatIfRunSerializer(serializers.Serializer):
    """A what-if run: queued, done (with its result) or failed (with why)."""

    id = serializers.CharField()
    policy = serializers.IntegerField()
    minutes = serializers.IntegerField()
    status = serializers.ChoiceField(choices=["pending", "done", "failed"])
    url = serializers.CharField(required=False, help_text="Where to fetch the run.")
    error = serializers.CharField(required=False)
    result = WhatIfResultSerializer(required=False)


class ExperimentStartSerializer(ExactSerializer):
    """Start a shadow or canary (issue 23) of a stored version or of a policy's draft (exactly one)."""

    kind = serializers.ChoiceField(choices=ExperimentKindChoices.choices)
    version = StrictIntegerField(
        min_value=1, max_value=2**31 - 1, required=False, help_text="Number of a stored policy version."
    )
    policy = StrictIntegerField(
        min_value=1,
        max_value=2**31 - 1,
        required=False,
        help_text="Id of a policy whose draft (as it is now) is compiled and run.",
    )
    share_percent = StrictFloatField(
        required=False, help_text="Canary only: the share of sessions it serves, more than 0 and at most 50."
    )
    margin_ms = StrictFloatField(required=False, min_value=0.0, max_value=10_000.0)
    margin_error_rate = StrictFloatField(required=False, min_value=0.0, max_value=1.0)
    min_samples = StrictIntegerField(required=False, min_value=2, max_value=10_000_000)
    alpha = StrictFloatField(required=False, min_value=1e-6, max_value=0.5)
    note = StrictCharField(max_length=500, required=False, allow_blank=True, default="")

    def validate(self, data: dict) -> dict:
        if ("version" in data) == ("policy" in data):
            raise serializers.ValidationError(
                {
                    "version": "Give either version (a stored version's number) or policy (a draft's policy id)."
                }
            )
        if "version" in data:
            version = PolicyVersion.objects.select_related("policy").filter(number=data["version"]).first()
            if version is None:
                raise serializers.ValidationError(
                    {
                        "version": f"No policy version {data['version']}; GET /api/v1/policy-versions/ lists them."
                    }
                )
            data["source_version"], data["policy_object"] = version, version.policy
        else:
            policy = RoutingPolicy.objects.filter(pk=data["policy"]).first()
            if policy is None:
                raise serializers.ValidationError(
                    {"policy": f"No policy {data['policy']}; GET /api/v1/policies/ lists them."}
                )
            data["source_version"], data["policy_object"] = None, policy
        share = data.get("share_percent")
        if data["kind"] == ExperimentKindChoices.CANARY:
            if share is None or not 0 < share <= MAX_CANARY_SHARE * 100:
                raise serializers.ValidationError(
                    {"share_percent": "A canary's share must be more than 0 and at most 50 (%)."}
                )
        elif share is not None:
            raise serializers.ValidationError(
                {"share_percent": "Only a canary serves a share; a shadow serves none."}
            )
        return data


class ExperimentEndSerializer(ExactSerializer):
    note = StrictCharField(max_length=500, required=False, allow_blank=True, default="")


class PolicyExperimentSerializer(serializers.ModelSerializer):
    """A shadow or canary: what runs, since when, and the workers' figures per region."""

    url = serializers.HyperlinkedIdentityField(view_name="policyexperiment-detail")
    policy = NestedRoutingPolicySerializer(read_only=True)
    source_version = serializers.IntegerField(source="source_version.number", read_only=True, allow_null=True)
    started_version = serializers.IntegerField(
        source="started_version.number", read_only=True, allow_null=True
    )
    ended_version = serializers.IntegerField(source="ended_version.number", read_only=True, allow_null=True)
    trial = serializers.SerializerMethodField(help_text="The trial's compiled policy settings.")
    comparison = serializers.SerializerMethodField(
        help_text="Canary: per region, canary against the rest with always-valid intervals (mSPRT)."
    )

    class Meta:
        model = PolicyExperiment
        fields = [
            "id",
            "url",
            "kind",
            "status",
            "policy",
            "source_version",
            "trial",
            "share_percent",
            "margin_ms",
            "margin_error_rate",
            "min_samples",
            "alpha",
            "started_at",
            "started_by",
            "started_version",
            "ended_at",
            "ended_by",
            "ended_version",
            "end_note",
            "figures",
            "figures_updated_at",
            "comparison",
        ]

    @extend_schema_field(OpenApiTypes.OBJECT)
    def get_trial(self, experiment: PolicyExperiment) -> dict:
        return msgspec.json.decode(experiment.spec)

    @extend_schema_field(serializers.ListField(child=serializers.DictField()))
    def get_comparison(self, experiment: PolicyExperiment) -> list[dict]:
        if experiment.kind != ExperimentKindChoices.CANARY:
            return []
        return [verdict.as_json() for verdict in experiments.verdicts(experiment)]
