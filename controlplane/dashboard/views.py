"""Dashboard pages (overview, TTFT breakdown, cache, key usage, nodes) and node actions.

Pages are server-rendered with the fleet and the latest live state embedded as JSON, so they show
numbers before the socket connects and keep the last ones when it drops; each page's script then
loads history from the chart-data views below (``series.py``) and applies live updates from
``/ws/dashboard/``. Policy pages are in ``policy_views.py``.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin, PermissionRequiredMixin
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.views import View
from django.views.generic import TemplateView

from controlplane import audit
from controlplane.dashboard import pagedata, series
from controlplane.dashboard.vendor import PLOTLY_VERSION
from controlplane.fleet.choices import NodeStateChoices
from controlplane.fleet.models import Node
from controlplane.policies.models import RoutingPolicy
from telemetry.models import ProcessedRequestEntry

# The time windows the history charts offer, and the aggregate resolution each one reads.
WINDOWS: dict[str, dict[str, Any]] = {
    "15m": {"label": "15 min", "seconds": 15 * 60, "resolution": "10s"},
    "1h": {"label": "1 h", "seconds": 3600, "resolution": "1m"},
    "24h": {"label": "24 h", "seconds": 24 * 3600, "resolution": "1m"},
}
DEFAULT_WINDOW = "15m"


def is_operator(user: Any) -> bool:
    """Operators may change policies and node states; everyone else signed in only looks."""
    return user.has_perm("policies.change_routingpolicy") or user.has_perm("fleet.change_node")


class PageChrome(LoginRequiredMixin):
    """What every signed-in page shares: the nav, the role, the fleet (for colours), its script."""

    page = ""
    script = ""
    uses_plotly = False
    uses_live = False

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context.update(
            page=self.page,
            page_script=f"gorgo/{self.script or self.page}.js",
            uses_plotly=self.uses_plotly,
            uses_live=self.uses_live,
            plotly_version=PLOTLY_VERSION,
            is_operator=is_operator(self.request.user),
        )
        context["page_data"] = {"fleet": pagedata.fleet(), **self.page_data()}
        return context

    def page_data(self) -> dict[str, Any]:
        return {}


class DashboardPage(PageChrome, TemplateView):
    """A live page: the latest state embedded, history from the data views, updates from the socket."""

    uses_plotly = True
    uses_live = True
    uses_window = False

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        window = self.request.GET.get("window", DEFAULT_WINDOW)
        self.window = window if window in WINDOWS else DEFAULT_WINDOW
        context = super().get_context_data(**kwargs)
        context.update(windows=WINDOWS if self.uses_window else {}, window=self.window)
        return context

    def page_data(self) -> dict[str, Any]:
        return {
            "live": pagedata.snapshot(),
            "windows": WINDOWS,
            "window": self.window,
            "urls": {
                "overview": reverse("dashboard:data-overview"),
                "breakdown": reverse("dashboard:data-breakdown"),
                "cache": reverse("dashboard:data-cache"),
                "key_usage": reverse("dashboard:data-key-usage"),
            },
        }


class OverviewPage(DashboardPage):
    """Headline, latency map, RTT matrix, TTFT and request rate per region."""

    template_name = "dashboard/overview.html"
    page = "overview"

    def page_data(self) -> dict[str, Any]:
        return {**super().page_data(), "policy": pagedata.active_policy()}


class BreakdownPage(DashboardPage):
    """Where TTFT goes, per region and per node, over a selectable window; and one request's own
    figures, found by its x-request-id (``?request_id=``)."""

    template_name = "dashboard/breakdown.html"
    page = "breakdown"
    uses_window = True

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        request_id = self.request.GET.get("request_id", "").strip()[:128]
        if request_id:
            entry = ProcessedRequestEntry.find(request_id)
            context.update(
                request_id=request_id,
                found_request=pagedata.request_rows(entry.decoded()) if entry is not None else None,
                request_missing=ProcessedRequestEntry.not_found_message(request_id) if entry is None else "",
            )
        return context


class CachePage(DashboardPage):
    """Prefix-cache hit rate and KV usage per node; routed vs hit tokens; each node's index mode."""

    template_name = "dashboard/cache.html"
    page = "cache"
    uses_window = True

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["nodes"] = pagedata.node_rows()
        return context


class KeyUsagePage(DashboardPage):
    """Requests, tokens, errors and TTFT per client key and per team, over a selectable window."""

    template_name = "dashboard/key_usage.html"
    page = "key-usage"
    uses_window = True

    def page_data(self) -> dict[str, Any]:
        # Embedded so the tables show numbers before the first reload.
        spec = WINDOWS[self.window]
        window = series.Window.of(self.window, spec["seconds"], spec["resolution"])
        return {**super().page_data(), "usage": series.key_usage(window)}


class NodesPage(DashboardPage):
    """Every node with its live figures, and drain/enable for operators."""

    template_name = "dashboard/nodes.html"
    page = "nodes"
    uses_plotly = False

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["nodes"] = pagedata.node_rows()
        context["regions"] = context["page_data"]["fleet"]["regions"]
        context["changes"] = audit.recent(Node, RoutingPolicy)
        return context


class NodeStateView(LoginRequiredMixin, PermissionRequiredMixin, View):
    """Drain or enable a node (operators), recording who did it; the policy republishes itself."""

    permission_required = "fleet.change_node"
    http_method_names = ["post"]
    target_state: NodeStateChoices = NodeStateChoices.ACTIVE
    verb = ""

    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        node = get_object_or_404(Node, pk=pk)
        previous = node.state
        if node.set_state(self.target_state):
            audit.record(request.user, node, f"state: {previous} -> {self.target_state} (dashboard)")
            messages.success(request, f"{node.name} {self.verb}: state {self.target_state}.")
        else:
            messages.info(request, f"{node.name} was already {self.target_state}.")
        return HttpResponseRedirect(reverse("dashboard:nodes"))


class DrainNodeView(NodeStateView):
    """Finish running work, take no new requests."""

    target_state = NodeStateChoices.DRAINING
    verb = "drained"


class EnableNodeView(NodeStateView):
    """Route to the node again."""

    target_state = NodeStateChoices.ACTIVE
    verb = "enabled"


def _window(request: HttpRequest) -> series.Window:
    key = request.GET.get("window", DEFAULT_WINDOW)
    if key not in WINDOWS:
        raise BadWindow(key)
    spec = WINDOWS[key]
    return series.Window.of(key, spec["seconds"], spec["resolution"])


class BadWindow(ValueError):
    """The ``window`` parameter is not one the pages offer."""


class ChartData(View):
    """JSON a page's charts load (and reload when live updates arrive). Signed-in users only."""

    http_method_names = ["get"]

    def get(self, request: HttpRequest) -> HttpResponse:
        if not request.user.is_authenticated:
            return JsonResponse({"detail": "Sign in first."}, status=403)
        try:
            data = self.data(request)
        except BadWindow as exc:
            return JsonResponse(
                {"window": f"Unknown window {exc}; use one of {', '.join(WINDOWS)}."}, status=400
            )
        response = JsonResponse(data)
        response["Cache-Control"] = "no-store"
        return response

    def data(self, request: HttpRequest) -> dict[str, Any]:
        raise NotImplementedError


class OverviewData(ChartData):
    """``series.overview``: headline, per-region figures, 15 min of 10 s buckets."""

    def data(self, request: HttpRequest) -> dict[str, Any]:
        return series.overview()


class BreakdownData(ChartData):
    """``series.breakdown`` over ``?window=``."""

    def data(self, request: HttpRequest) -> dict[str, Any]:
        return series.breakdown(_window(request))


class KeyUsageData(ChartData):
    """``series.key_usage`` over ``?window=``."""

    def data(self, request: HttpRequest) -> dict[str, Any]:
        return series.key_usage(_window(request))


class CacheData(ChartData):
    """``series.cache`` over ``?window=``."""

    def data(self, request: HttpRequest) -> dict[str, Any]:
        return series.cache(_window(request))
