from __future__ import annotations

from rest_framework.routers import SimpleRouter

from controlplane.fleet.api import views

router = SimpleRouter()
router.register("regions", views.RegionViewSet, basename="region")
router.register("models", views.LLMModelViewSet, basename="model")
router.register("nodes", views.NodeViewSet, basename="node")

urlpatterns = router.urls
