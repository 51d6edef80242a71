"""Django admin for the fleet: regions, models and nodes, with drain/enable actions on nodes."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db import transaction
from django.db.models import Count, QuerySet
from django.http import HttpRequest

from controlplane.deletion import delete_blockers
from controlplane.fleet.choices import NodeStateChoices
from controlplane.fleet.models import LLMModel, Node, Region


class InUseDeleteMixin:
    """Lists why an object is still in use on the delete page, so the admin refuses like the API."""

    def get_deleted_objects(self, objs, request):
        to_delete, model_count, perms_needed, protected = super().get_deleted_objects(objs, request)
        for obj in objs:
            protected.extend(delete_blockers(obj))
        return to_delete, model_count, perms_needed, protected


@admin.register(Region)
class RegionAdmin(InUseDeleteMixin, admin.ModelAdmin):
    list_display = ["slug", "name", "latitude", "longitude", "provider", "zone", "node_count"]
    search_fields = ["slug", "name"]
    list_filter = ["provider"]

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).annotate(node_count=Count("nodes"))

    @admin.display(ordering="node_count", description="nodes")
    def node_count(self, region: Region) -> int:
        return region.node_count


@admin.register(LLMModel)
class LLMModelAdmin(InUseDeleteMixin, admin.ModelAdmin):
    list_display = ["name", "kv_block_size", "max_context_tokens", "node_count"]
    search_fields = ["name"]

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).annotate(node_count=Count("nodes"))

    @admin.display(ordering="node_count", description="nodes")
    def node_count(self, model: LLMModel) -> int:
        return model.node_count


@admin.register(Node)
class NodeAdmin(InUseDeleteMixin, admin.ModelAdmin):
    list_display = ["name", "region", "state", "base_url", "gpu_type", "gpu_count", "last_updated"]
    list_filter = ["state", "region", "served_models", "gpu_type"]
    list_select_related = ["region"]
    search_fields = ["name", "base_url"]
    filter_horizontal = ["served_models"]
    readonly_fields = ["created", "last_updated"]
    actions = ["drain", "enable"]

    @admin.action(
        description="Drain selected nodes (finish running work, take no new)", permissions=["change"]
    )
    def drain(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._move_to(request, queryset, NodeStateChoices.DRAINING)

    @admin.action(description="Enable selected nodes", permissions=["change"])
    def enable(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._move_to(request, queryset, NodeStateChoices.ACTIVE)

    def _move_to(self, request: HttpRequest, queryset: QuerySet, state: NodeStateChoices) -> None:
        # One transaction: the republish after commit sees every node moved (later ones find no change).
        with transaction.atomic():
            moved = [node for node in queryset if node.set_state(state)]
        for node in moved:
            self.log_change(request, node, f"state: {state} (admin action)")
        if moved:
            self.message_user(
                request, f"{state.label}: {', '.join(n.name for n in moved)}.", messages.SUCCESS
            )
        else:
            self.message_user(
                request, f"Every selected node was already {state.label.lower()}.", messages.INFO
            )
