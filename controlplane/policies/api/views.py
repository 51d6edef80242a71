"""Policies API: CRUD declarations, the publish/validate/rollback/diff actions, read-only versions."""

from __future__ import annotations

import time

from django.db import transaction
from django.db.models import Max
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api import BaseModelViewSet, BaseReadOnlyViewSet
from controlplane.permissions import required_perms
from controlplane.policies import experiments, publishing, review, tasks, whatif
from controlplane.policies.api.serializers import (
    ExperimentEndSerializer,
    ExperimentStartSerializer,
    PolicyDiffSerializer,
    PolicyExperimentSerializer,
    PolicyValidationSerializer,
    PolicyVersionSerializer,
    PublishRequestSerializer,
    RollbackRequestSerializer,
    RoutingPolicySerializer,
    WhatIfRequestSerializer,
    WhatIfRunSerializer,
)
from controlplane.policies.filtersets import (
    PolicyExperimentFilterSet,
    PolicyVersionFilterSet,
    RoutingPolicyFilterSet,
)
from controlplane.policies.models import PolicyExperiment, PolicyVersion, RoutingPolicy

_INVALID = OpenApiResponse(OpenApiTypes.OBJECT, description="The policy is invalid: field errors.")
_PUBLISHED = {
    201: OpenApiResponse(PolicyVersionSerializer, description="A new version is live."),
    200: OpenApiResponse(PolicyVersionSerializer, description="Unchanged: this version was already live."),
    400: _INVALID,
    503: OpenApiResponse(OpenApiTypes.OBJECT, description="Redis is unreachable; nothing was recorded."),
}


class RoutingPolicyViewSet(BaseModelViewSet):
    queryset = RoutingPolicy.objects.prefetch_related("model_scope").annotate(
        latest_version_number=Max("versions__number")
    )
    serializer_class = RoutingPolicySerializer
    filterset_class = RoutingPolicyFilterSet

    @extend_schema(
        request=PublishRequestSerializer,
        responses={
            **_PUBLISHED,
            409: OpenApiResponse(OpenApiTypes.OBJECT, description="Changed since review."),
        },
        summary="Compile and publish",
    )
    @action(detail=True, methods=["post"])
    @required_perms("policies.publish_routingpolicy")
    def publish(self, request: Request, pk: str | None = None) -> Response:
        policy = self.get_object()
        body = PublishRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        result = publishing.publish(
            policy,
            author=request.user,
            note=body.validated_data["note"],
            reviewed_checksum=body.validated_data.get("checksum"),
        )
        return self._published(result)

    @extend_schema(
        request=RollbackRequestSerializer,
        responses={
            **_PUBLISHED,
            404: OpenApiResponse(
                OpenApiTypes.OBJECT, description="No such policy, or no such version of it."
            ),
        },
        summary="Publish an earlier version again",
    )
    @action(detail=True, methods=["post"])
    @required_perms("policies.publish_routingpolicy")
    def rollback(self, request: Request, pk: str | None = None) -> Response:
        policy = self.get_object()
        body = RollbackRequestSerializer(data=request.data, context={"policy": policy})
        body.is_valid(raise_exception=True)
        result = publishing.rollback(
            body.validated_data["version"], author=request.user, note=body.validated_data["note"]
        )
        return self._published(result)

    @extend_schema(
        request=None,
        responses={200: PolicyValidationSerializer, 400: _INVALID},
        summary="Dry run: compile with the current fleet, publish nothing",
    )
    @action(detail=True, methods=["post"])
    @required_perms()  # writes nothing: any authenticated user may check a policy
    def validate(self, request: Request, pk: str | None = None) -> Response:
        reviewed = review.review_policy(self.get_object())
        answer = {
            "valid": True,
            "checksum": reviewed.checksum,
            "live_version": reviewed.live.number if reviewed.live else None,
            "differs_from_live": reviewed.differs_from_live,
            "summary": reviewed.summary,
        }
        return Response(PolicyValidationSerializer(answer).data)

    @extend_schema(
        responses={200: PolicyDiffSerializer, 400: _INVALID}, summary="Changes against the live snapshot"
    )
    @action(detail=True, methods=["get"])
    def diff(self, request: Request, pk: str | None = None) -> Response:
        reviewed = review.review_policy(self.get_object())
        live = reviewed.live
        answer = {
            "live_version": live.number if live else None,
            "live_policy": live.policy.name if live else None,
            "live_checksum": live.checksum if live else None,
            "checksum": reviewed.checksum,
            "changed": bool(reviewed.changes),
            "changes": reviewed.changes,
        }
        return Response(PolicyDiffSerializer(answer).data)

    @extend_schema(
        request=WhatIfRequestSerializer,
        responses={
            202: OpenApiResponse(WhatIfRunSerializer, description="Queued; fetch the run's url."),
            400: OpenApiResponse(OpenApiTypes.OBJECT, description="Bad minutes, or the policy is invalid."),
            409: OpenApiResponse(
                OpenApiTypes.OBJECT, description="No traffic in the window, or no version is live."
            ),
        },
        summary="What if: replay recent traffic with this policy and with the live one",
    )
    @action(detail=True, methods=["post"], url_path="what-if")
    @required_perms()  # writes nothing but a short-lived result: any authenticated user may ask
    def what_if(self, request: Request, pk: str | None = None) -> Response:
        policy = self.get_object()
        body = WhatIfRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        minutes = body.validated_data["minutes"]
        now_s = time.time()
        whatif.check_window(policy, minutes, now_s)
        run_id = whatif.new_run(policy.pk, minutes)
        transaction.on_commit(lambda: tasks.what_if.delay(run_id, policy.pk, minutes, now_s))
        answer = {
            "id": run_id,
            "policy": policy.pk,
            "minutes": minutes,
            "status": "pending",
            "url": f"/api/v1/policies/{policy.pk}/what-if/{run_id}/",
        }
        return Response(WhatIfRunSerializer(answer).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        request=None,
        responses={
            200: WhatIfRunSerializer,
            404: OpenApiResponse(OpenApiTypes.OBJECT, description="No such run (they are kept an hour)."),
        },
        summary="A what-if run: pending, done with its result, or failed with why",
    )
    @action(detail=True, methods=["get"], url_path=r"what-if/(?P<run_id>[0-9a-f]{32})")
    def what_if_run(self, request: Request, pk: str | None = None, run_id: str = "") -> Response:
        policy = self.get_object()
        run = whatif.load_run(run_id)
        if run is None or run.get("policy") != policy.pk:
            raise NotFound("No such what-if run of this policy (runs are kept for an hour).")
        return Response(WhatIfRunSerializer(run).data)

    def _published(self, result: publishing.PublishResult) -> Response:
        data = PolicyVersionSerializer(result.version, context=self.get_serializer_context()).data
        return Response(data, status=status.HTTP_201_CREATED if result.created else status.HTTP_200_OK)


class PolicyVersionViewSet(BaseReadOnlyViewSet):
    queryset = PolicyVersion.objects.select_related("policy", "rolled_back_from")
    serializer_class = PolicyVersionSerializer
    filterset_class = PolicyVersionFilterSet


_EXPERIMENT_STEP = {
    200: PolicyExperimentSerializer,
    409: OpenApiResponse(OpenApiTypes.OBJECT, description="It is not running."),
    503: OpenApiResponse(OpenApiTypes.OBJECT, description="Redis is unreachable; nothing changed."),
}


class PolicyExperimentViewSet(BaseReadOnlyViewSet):
    """Shadows and canaries (issue 23): list and status (with figures); start, stop, promote."""

    queryset = PolicyExperiment.objects.select_related(
        "policy", "source_version", "started_version", "ended_version"
    )
    serializer_class = PolicyExperimentSerializer
    filterset_class = PolicyExperimentFilterSet

    @extend_schema(
        request=ExperimentStartSerializer,
        responses={
            201: PolicyExperimentSerializer,
            400: _INVALID,
            409: OpenApiResponse(
                OpenApiTypes.OBJECT, description="One of this kind is running, or nothing is live yet."
            ),
            503: OpenApiResponse(OpenApiTypes.OBJECT, description="Redis is unreachable; nothing changed."),
        },
        summary="Start a shadow or a canary",
    )
    @required_perms("policies.publish_routingpolicy")
    def create(self, request: Request) -> Response:
        body = ExperimentStartSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        version = data["source_version"]
        spec = (
            experiments.trial_from_version(version)
            if version is not None
            else experiments.trial_from_draft(data["policy_object"])
        )
        defaults = experiments.CanaryLimits()
        experiment = experiments.start(
            data["kind"],
            policy=data["policy_object"],
            spec=spec,
            source_version=version,
            user=request.user,
            share_percent=data.get("share_percent"),
            limits=experiments.CanaryLimits(
                margin_ms=data.get("margin_ms", defaults.margin_ms),
                margin_error_rate=data.get("margin_error_rate", defaults.margin_error_rate),
                min_samples=data.get("min_samples", defaults.min_samples),
                alpha=data.get("alpha", defaults.alpha),
            ),
            note=data["note"],
        )
        serializer = self.get_serializer(experiment)
        return Response(serializer.data, status=status.HTTP_201_CREATED)

    @extend_schema(request=ExperimentEndSerializer, responses=_EXPERIMENT_STEP, summary="Stop it")
    @action(detail=True, methods=["post"])
    @required_perms("policies.publish_routingpolicy")
    def stop(self, request: Request, pk: str | None = None) -> Response:
        body = ExperimentEndSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        experiment = experiments.stop(self.get_object(), user=request.user, note=body.validated_data["note"])
        return Response(self.get_serializer(experiment).data)

    @extend_schema(
        request=ExperimentEndSerializer, responses=_EXPERIMENT_STEP, summary="Publish it as the live policy"
    )
    @action(detail=True, methods=["post"])
    @required_perms("policies.publish_routingpolicy")
    def promote(self, request: Request, pk: str | None = None) -> Response:
        body = ExperimentEndSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        experiment = experiments.promote(
            self.get_object(), user=request.user, note=body.validated_data["note"]
        )
        return Response(self.get_serializer(experiment).data)
