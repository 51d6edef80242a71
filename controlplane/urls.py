from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from controlplane.metrics import metrics_view

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
    # Last: the dashboard owns "/" and the pages under it.
    path("", include("controlplane.dashboard.urls")),
]
