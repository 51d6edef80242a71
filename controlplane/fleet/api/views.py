"""Fleet API viewsets: declarations, plus the node's drain/enable actions."""

from __future__ import annotations

from django.db.models import Count
from drf_spectacular.utils import extend_schema
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane import audit
from controlplane.api import BaseModelViewSet
from controlplane.fleet.api.serializers import LLMModelSerializer, NodeSerializer, RegionSerializer
from controlplane.fleet.choices import NodeStateChoices
from controlplane.fleet.filtersets import LLMModelFilterSet, NodeFilterSet, RegionFilterSet
from controlplane.fleet.models import LLMModel, Node, Region
from controlplane.permissions import required_perms


class RegionViewSet(BaseModelViewSet):
    queryset = Region.objects.annotate(node_count=Count("nodes"))
    serializer_class = RegionSerializer
    filterset_class = RegionFilterSet


class LLMModelViewSet(BaseModelViewSet):
    queryset = LLMModel.objects.annotate(node_count=Count("nodes"))
    serializer_class = LLMModelSerializer
    filterset_class = LLMModelFilterSet


class NodeViewSet(BaseModelViewSet):
    queryset = Node.objects.select_related("region").prefetch_related("served_models")
    serializer_class = NodeSerializer
    filterset_class = NodeFilterSet

    @extend_schema(request=None, responses=NodeSerializer, summary="Drain: finish running work, take no new")
    @action(detail=True, methods=["post"])
    @required_perms("fleet.change_node")
    def drain(self, request: Request, pk: str | None = None) -> Response:
        return self._move_to(NodeStateChoices.DRAINING)

    @extend_schema(request=None, responses=NodeSerializer, summary="Enable: route to the node again")
    @action(detail=True, methods=["post"])
    @required_perms("fleet.change_node")
    def enable(self, request: Request, pk: str | None = None) -> Response:
        return self._move_to(NodeStateChoices.ACTIVE)

    def _move_to(self, state: NodeStateChoices) -> Response:
        node = self.get_object()
        old_state = node.state
        if node.set_state(state):  # the fleet-change signal republishes the active policy
            audit.record(self.request.user, node, f"state: {old_state} -> {state} (through the API)")
        return Response(self.get_serializer(node).data)
