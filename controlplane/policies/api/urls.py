from __future__ import annotations

from rest_framework.routers import SimpleRouter

from controlplane.policies.api import views

router = SimpleRouter()
router.register("policies", views.RoutingPolicyViewSet, basename="policy")
router.register("policy-versions", views.PolicyVersionViewSet, basename="policyversion")
router.register("policy-experiments", views.PolicyExperimentViewSet, basename="policyexperiment")

urlpatterns = router.urls
