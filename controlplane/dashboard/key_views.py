"""The Client keys page: list the keys, create one (its secret is shown on that answer only),
revoke and rotate. The same model methods and the same Redis publishing as the REST API."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin, PermissionRequiredMixin
from django.db import transaction
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import reverse
from django.views import View
from django.views.generic import TemplateView

from controlplane import audit
from controlplane.dashboard.forms import ClientKeyForm
from controlplane.dashboard.views import PageChrome
from controlplane.keys.models import ClientKey
from controlplane.keys.publishing import sync_last_used


class KeyListView(PageChrome, TemplateView):
    """Every client key with its limits and last use; a create form for operators."""

    template_name = "dashboard/key_list.html"
    page = "keys"

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        sync_last_used()
        context["keys"] = ClientKey.objects.prefetch_related("allowed_models", "allowed_regions")
        context.setdefault("form", ClientKeyForm())
        context["can_manage"] = self.request.user.has_perm("keys.add_clientkey")
        return context

    def post(self, request: HttpRequest) -> HttpResponse:
        """Create a key; the answer (not a redirect) is the one page that ever shows its secret."""
        if not request.user.has_perm("keys.add_clientkey"):
            return HttpResponse(status=403)
        form = ClientKeyForm(request.POST)
        if not form.is_valid():
            return self.render_to_response(self.get_context_data(form=form), status=400)
        with transaction.atomic():
            key = form.save(commit=False)
            secret = key.set_new_secret()
            key.save()
            form.save_m2m()
            audit.record(request.user, key, "Created in the dashboard.", added=True)
        return _with_secret(self, key, secret)


def _with_secret(view: KeyListView, key: ClientKey, secret: str) -> HttpResponse:
    response = view.render_to_response(view.get_context_data(new_key=key, new_secret=secret))
    response["Cache-Control"] = "no-store"  # the secret must not land in any cache
    return response


class KeyActionView(LoginRequiredMixin, PermissionRequiredMixin, View):
    permission_required = "keys.change_clientkey"
    http_method_names = ["post"]


class RevokeKeyView(KeyActionView):
    """Revoke: every gateway refuses the key within a second."""

    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        key = get_object_or_404(ClientKey, pk=pk)
        if not key.revoked:
            key.revoke()
            audit.record(request.user, key, "Revoked in the dashboard.")
            messages.success(request, f"Key {key.name} ({key.key_id}) revoked.")
        return HttpResponseRedirect(reverse("dashboard:key-list"))


class RotateKeyView(KeyActionView):
    """Rotate: a new secret, shown once; the old one stops working."""

    def post(self, request: HttpRequest, pk: int) -> HttpResponse | TemplateResponse:
        key = get_object_or_404(ClientKey, pk=pk)
        secret = key.set_new_secret()
        key.save(update_fields=["secret_sha256", "last_updated"])
        audit.record(request.user, key, "Secret rotated in the dashboard.")
        view = KeyListView()
        view.setup(request)
        return _with_secret(view, key, secret)
