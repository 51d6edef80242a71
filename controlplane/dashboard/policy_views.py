"""The policy editor: list, create/edit, review the diff against the live snapshot, publish, roll back.

Validation is ``RoutingPolicy.clean()``; compiling, diffing and publishing are the policies app's
``publishing`` and ``review`` functions, the same ones the REST API calls. Edits are recorded in
the audit trail; publishes and rollbacks are recorded by ``PolicyVersion`` (author, note, time).
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin, PermissionRequiredMixin
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db import transaction
from django.db.models import Count, Max, Q
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.views import View
from django.views.generic import CreateView, DetailView, ListView, UpdateView

from controlplane import audit
from controlplane.api import ConflictError
from controlplane.dashboard.forms import PolicyForm, PublishForm, RollbackForm
from controlplane.dashboard.signals import experiment_message
from controlplane.dashboard.views import PageChrome
from controlplane.policies import publishing, review
from controlplane.policies.choices import ExperimentStatusChoices
from controlplane.policies.models import PolicyExperiment, PolicyVersion, RoutingPolicy

VERSIONS_PER_PAGE = 25


class PolicyPageMixin(PageChrome):
    """Policy pages: the nav highlights "Policies"; no charts, no live socket."""

    page = "policies"
    script = "policies"


class PolicyListView(PolicyPageMixin, ListView):
    """Every policy, the live version, recent versions and edits."""

    template_name = "dashboard/policy_list.html"
    context_object_name = "policies"

    def get_queryset(self):
        return RoutingPolicy.objects.annotate(
            version_count=Count("versions"), latest_version=Max("versions__number")
        ).order_by("-is_active", "name")

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["live"] = publishing.live_version()
        context["recent_versions"] = PolicyVersion.objects.select_related("policy")[:10]
        context["changes"] = audit.recent(RoutingPolicy)
        return context


class PolicyEditMixin(PolicyPageMixin, PermissionRequiredMixin):
    """Create and edit: validate through the model, save, record the change; never publish."""

    model = RoutingPolicy
    form_class = PolicyForm
    template_name = "dashboard/policy_form.html"

    def form_valid(self, form: PolicyForm) -> HttpResponse:
        adding = form.instance.pk is None
        before = {} if adding else RoutingPolicy.objects.get(pk=form.instance.pk).audit_state()
        with transaction.atomic():
            self.object = form.save()
            after = self.object.audit_state()
            summary = "created" if adding else RoutingPolicy.describe_audit_changes(before, after)
            if summary:
                audit.record(self.request.user, self.object, summary, added=adding)
        if adding:
            messages.success(self.request, f"Policy {self.object.name} created. Review it, then publish.")
        elif summary:
            messages.success(self.request, f"Saved {self.object.name}: {summary}. Not live until published.")
        else:
            messages.info(self.request, "Nothing changed.")
        return HttpResponseRedirect(reverse("dashboard:policy-detail", args=[self.object.pk]))


class PolicyCreateView(PolicyEditMixin, CreateView):
    """A new policy, as a draft."""

    permission_required = "policies.add_routingpolicy"


class PolicyUpdateView(PolicyEditMixin, UpdateView):
    """Edit a policy's draft; the live version is untouched until published."""

    permission_required = "policies.change_routingpolicy"


TUNING_WINDOWS_SHOWN = 30
EXPERIMENTS_SHOWN = 5


def policy_review(policy: RoutingPolicy) -> dict[str, Any]:
    """The policies layer's review of ``policy`` for the page: field errors instead of a diff when
    it does not compile."""
    try:
        reviewed = review.review_policy(policy)
    except ValidationError as exc:
        errors = exc.message_dict if hasattr(exc, "error_dict") else {"policy": exc.messages}
        live = publishing.live_version()
        return {"live": live, "errors": errors, "changes": [], "checksum": "", "summary": None}
    return {
        "live": reviewed.live,
        "errors": None,
        "changes": reviewed.changes,
        "checksum": reviewed.checksum,
        "summary": reviewed.summary,
        "is_live": reviewed.is_live,
    }


class PolicyDetailView(PolicyPageMixin, DetailView):
    """Review (diff against live), what-if replay, publish, version history with rollback, edits."""

    model = RoutingPolicy
    template_name = "dashboard/policy_detail.html"
    context_object_name = "policy"
    uses_plotly = True  # the what-if panel's charts

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        policy = self.object
        context["review"] = policy_review(policy)
        # Paged: a fleet that changes all day publishes thousands of versions.
        versions = Paginator(
            policy.versions.select_related("rolled_back_from").order_by("-number"), VERSIONS_PER_PAGE
        ).get_page(self.request.GET.get("page"))
        context["versions"] = versions
        context["publish_form"] = PublishForm(initial={"checksum": context["review"]["checksum"]})
        context["changes"] = audit.recent_for(policy)
        context["can_publish"] = self.request.user.has_perm("policies.publish_routingpolicy")
        context["can_edit"] = self.request.user.has_perm("policies.change_routingpolicy")
        context["tuning_windows"] = list(
            policy.tuning_windows.select_related("version")[:TUNING_WINDOWS_SHOWN]
        )
        # Shadows and canaries run fleet-wide: every policy page shows the running ones, and this
        # policy's recent ones; policies.js draws them and follows their policy.experiment pushes.
        shown = PolicyExperiment.objects.filter(
            Q(status=ExperimentStatusChoices.RUNNING) | Q(policy=policy)
        ).select_related("policy", "source_version")[:EXPERIMENTS_SHOWN]
        context["experiments"] = [experiment_message(experiment) for experiment in shown]
        return context


class PublishView(LoginRequiredMixin, PermissionRequiredMixin, View):
    """Publish the snapshot the operator reviewed (refused if it changed since)."""

    permission_required = "policies.publish_routingpolicy"
    http_method_names = ["post"]

    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        policy = get_object_or_404(RoutingPolicy, pk=pk)
        form = PublishForm(request.POST)
        back = HttpResponseRedirect(reverse("dashboard:policy-detail", args=[pk]))
        if not form.is_valid():
            messages.error(request, "Publish form was incomplete; review the diff and try again.")
            return back
        reviewed = policy_review(policy)
        if reviewed["errors"]:
            messages.error(request, "The policy is invalid; fix it before publishing.")
            return back
        if reviewed["checksum"] != form.cleaned_data["checksum"]:
            messages.warning(
                request, "The policy or the fleet changed after you reviewed the diff. Review it again."
            )
            return back
        return _publish_and_report(
            request,
            back,
            lambda: publishing.publish(
                policy,
                author=request.user,
                note=form.cleaned_data["note"],
                reviewed_checksum=form.cleaned_data["checksum"],
            ),
        )


class RollbackView(LoginRequiredMixin, PermissionRequiredMixin, View):
    """Publish the settings of an earlier version of this policy again, as a new version."""

    permission_required = "policies.publish_routingpolicy"
    http_method_names = ["post"]

    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        policy = get_object_or_404(RoutingPolicy, pk=pk)
        form = RollbackForm(request.POST, policy=policy)
        back = HttpResponseRedirect(reverse("dashboard:policy-detail", args=[pk]))
        if not form.is_valid():
            messages.error(request, " ".join(e for errors in form.errors.values() for e in errors))
            return back
        version = form.cleaned_data["version"]
        return _publish_and_report(
            request,
            back,
            lambda: publishing.rollback(version, author=request.user, note=form.cleaned_data["note"]),
        )


def _publish_and_report(request: HttpRequest, back: HttpResponse, run) -> HttpResponse:
    try:
        result = run()
    except ValidationError as exc:
        details = exc.message_dict if hasattr(exc, "error_dict") else {"policy": exc.messages}
        text = "; ".join(f"{field}: {' '.join(errs)}" for field, errs in details.items())
        messages.error(request, f"Not published: {text}")
    except publishing.PublishError as exc:
        messages.error(request, f"Not published, nothing changed: {exc.public_detail}")
    except ConflictError as exc:  # changed since the review (while it waited), or a lost race
        messages.warning(request, f"Not published, nothing changed: {exc.detail}")
    else:
        if result.created:
            messages.success(
                request, f"Published version {result.version.number}; the gateways switch to it now."
            )
        else:
            messages.info(request, f"No changes: version {result.version.number} is already live.")
    return back
