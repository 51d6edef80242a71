from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path, re_path
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from controlplane.metrics import metrics_view


@csrf_exempt  # a 404 for any method: no form to protect, and a CSRF 403 page would hide the 404
def api_not_found(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"detail": "Not found."}, status=404)


def server_error(request: HttpRequest) -> HttpResponse:
    """The 500 answer when DEBUG is off: JSON for API clients, Django's plain page otherwise.

    Never the technical page: that one exists only with DEBUG=true (development mode).
    """
    if request.path.startswith("/api/"):
        return JsonResponse(
            {"detail": "Server error; it has been logged.", "code": "server_error"}, status=500
        )
    return defaults.server_error(request)


handler500 = server_error

api_v1 = [
    path("", include("controlplane.fleet.api.urls")),
    path("", include("controlplane.policies.api.urls")),
    path("", include("controlplane.keys.api.urls")),
    path("telemetry/", include("telemetry.api.urls")),
]

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("metrics", metrics_view, name="metrics"),
    # Any other /api/ URL: a JSON 404, like the API's own (an HTML page would surprise a client).
    re_path(r"^api/", api_not_found),
    # Last: the dashboard owns "/" and the pages under it.
    path("", include("controlplane.dashboard.urls")),
]
