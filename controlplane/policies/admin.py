"""Django admin for routing policies (with a publish action) and their read-only version history."""

from __future__ import annotations

import json

from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from controlplane.fleet.admin import InUseDeleteMixin
from controlplane.policies import publishing
from controlplane.policies.models import PolicyExperiment, PolicyVersion, RoutingPolicy


def _report(modeladmin: admin.ModelAdmin, request: HttpRequest, action, *args) -> None:
    """Run a publish/rollback and tell the user what happened, in the admin's messages."""
    try:
        result = action(*args, author=request.user)
    except ValidationError as exc:
        details = "; ".join(f"{field}: {' '.join(errors)}" for field, errors in exc.message_dict.items())
        modeladmin.message_user(request, f"Not published, the policy is invalid: {details}", messages.ERROR)
    except publishing.PublishError as exc:
        modeladmin.message_user(request, f"Not published: {exc}", messages.ERROR)
    else:
        version = result.version
        if result.created:
            modeladmin.message_user(request, f"Published {version}.", messages.SUCCESS)
        else:
            modeladmin.message_user(request, f"Unchanged: {version} is already live.", messages.INFO)


class PolicyVersionInline(admin.TabularInline):
    model = PolicyVersion
    fk_name = "policy"
    fields = ["number", "checksum", "author_name", "note", "published_at"]
    readonly_fields = fields
    ordering = ["-number"]
    extra = 0
    max_num = 0
    show_change_link = True
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


@admin.register(RoutingPolicy)
class RoutingPolicyAdmin(InUseDeleteMixin, admin.ModelAdmin):
    list_display = ["name", "algorithm", "is_active", "max_rtt_ms", "last_updated"]
    list_filter = ["algorithm", "is_active"]
    search_fields = ["name", "description"]
    filter_horizontal = ["model_scope"]
    readonly_fields = ["is_active", "created", "last_updated"]
    inlines = [PolicyVersionInline]
    actions = ["publish"]

    def has_publish_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("policies.publish_routingpolicy")

    @admin.action(description="Publish the selected policy", permissions=["publish"])
    def publish(self, request: HttpRequest, queryset: QuerySet) -> None:
        if queryset.count() != 1:
            self.message_user(request, "Select exactly one policy: only one can be live.", messages.WARNING)
            return
        _report(self, request, publishing.publish, queryset.get())


@admin.register(PolicyVersion)
class PolicyVersionAdmin(admin.ModelAdmin):
    """Version history: immutable, so read-only; a version can be rolled back to."""

    list_display = [
        "number",
        "policy",
        "short_checksum",
        "author_name",
        "note",
        "published_at",
        "rolled_back_from",
    ]
    list_filter = ["policy"]
    list_select_related = ["policy", "rolled_back_from"]
    search_fields = ["note", "author_name", "checksum"]
    fields = [
        "number",
        "policy",
        "checksum",
        "author_name",
        "note",
        "rolled_back_from",
        "created",
        "published_at",
        "snapshot_json",
    ]
    readonly_fields = fields
    actions = ["rollback"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_publish_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("policies.publish_routingpolicy")

    @admin.display(description="checksum")
    def short_checksum(self, version: PolicyVersion) -> str:
        return version.checksum[:12]

    @admin.display(description="snapshot")
    def snapshot_json(self, version: PolicyVersion) -> str:
        return format_html("<pre>{}</pre>", json.dumps(json.loads(version.snapshot), indent=2))

    @admin.action(description="Roll back to the selected version", permissions=["publish"])
    def rollback(self, request: HttpRequest, queryset: QuerySet) -> None:
        if queryset.count() != 1:
            self.message_user(request, "Select exactly one version to roll back to.", messages.WARNING)
            return
        _report(self, request, publishing.rollback, queryset.get())


@admin.register(PolicyExperiment)
class PolicyExperimentAdmin(admin.ModelAdmin):
    """Shadows and canaries, read-only: the REST API starts, stops and promotes them (issue 23).

    Their page's history is the audit log of each step (the automatic rollback as gorgo-system).
    """

    list_display = ["id", "kind", "status", "policy", "share_percent", "started_by", "started_at", "ended_at"]
    list_filter = ["kind", "status"]
    list_select_related = ["policy"]
    fields = [
        "kind",
        "status",
        "policy",
        "source_version",
        "spec",
        "share_percent",
        "margin_ms",
        "margin_error_rate",
        "min_samples",
        "alpha",
        "started_by",
        "started_at",
        "started_version",
        "ended_by",
        "ended_at",
        "ended_version",
        "end_note",
        "figures",
        "figures_updated_at",
    ]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False
