from __future__ import annotations

from rest_framework.routers import SimpleRouter

from controlplane.keys.api import views

router = SimpleRouter()
router.register("client-keys", views.ClientKeyViewSet, basename="client-key")

urlpatterns = router.urls
