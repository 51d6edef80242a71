"""Django admin for client keys: a new key's secret is shown once, in the message after saving."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from controlplane.keys.models import ClientKey


@admin.register(ClientKey)
class ClientKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "key_id", "owner", "team", "priority", "requests_per_min", "tokens_per_min"]
    list_display += ["expires_at", "revoked", "last_used_at"]
    list_filter = ["priority", "revoked", "team"]
    search_fields = ["name", "key_id", "owner", "team"]
    filter_horizontal = ["allowed_models", "allowed_regions"]
    readonly_fields = ["key_id", "revoked_at", "last_used_at", "created", "last_updated"]
    actions = ["revoke_keys"]

    def save_model(self, request: HttpRequest, obj: ClientKey, form, change: bool) -> None:
        if not change:
            secret = obj.set_new_secret()
            messages.warning(request, f"The key's secret (shown only now, store it safely): {secret}")
        super().save_model(request, obj, form, change)

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet) -> None:
        for key in queryset:
            key.revoke()
        self.message_user(request, f"Revoked {queryset.count()} key(s).")
