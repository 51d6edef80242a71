"""Django admin for client keys: a new key's secret is shown once, on the page that answers the save.

Not in a message: Django's default message storage is a signed (readable) cookie, and a secret
must not travel or linger there."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

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
            request._client_key_secret = obj.set_new_secret()  # type: ignore[attr-defined]
        super().save_model(request, obj, form, change)

    def response_add(self, request: HttpRequest, obj: ClientKey, post_url_continue=None) -> HttpResponse:
        secret = getattr(request, "_client_key_secret", None)
        if secret is None:
            return super().response_add(request, obj, post_url_continue)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Client key {obj.name} ({obj.key_id}) created",
            "key": obj,
            "secret": secret,
            "opts": self.model._meta,
        }
        response = TemplateResponse(request, "admin/keys/clientkey/secret.html", context)
        response["Cache-Control"] = "no-store"
        return response

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet) -> None:
        for key in queryset:
            key.revoke()
        self.message_user(request, f"Revoked {queryset.count()} key(s).")
