"""Dashboard URLs: the sign-in pages, the live pages, node actions and the policy editor."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import path

from controlplane.dashboard import key_views, policy_views, vendor, views

app_name = "dashboard"

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.OverviewPage.as_view(), name="overview"),
    path("breakdown/", views.BreakdownPage.as_view(), name="breakdown"),
    path("cache/", views.CachePage.as_view(), name="cache"),
    path("nodes/", views.NodesPage.as_view(), name="nodes"),
    path("nodes/<int:pk>/drain/", views.DrainNodeView.as_view(), name="node-drain"),
    path("nodes/<int:pk>/enable/", views.EnableNodeView.as_view(), name="node-enable"),
    path("policies/", policy_views.PolicyListView.as_view(), name="policy-list"),
    path("policies/new/", policy_views.PolicyCreateView.as_view(), name="policy-create"),
    path("policies/<int:pk>/", policy_views.PolicyDetailView.as_view(), name="policy-detail"),
    path("policies/<int:pk>/edit/", policy_views.PolicyUpdateView.as_view(), name="policy-edit"),
    path("policies/<int:pk>/publish/", policy_views.PublishView.as_view(), name="policy-publish"),
    path("policies/<int:pk>/rollback/", policy_views.RollbackView.as_view(), name="policy-rollback"),
    path("keys/", key_views.KeyListView.as_view(), name="key-list"),
    path("keys/usage/", views.KeyUsagePage.as_view(), name="key-usage"),
    path("keys/<int:pk>/revoke/", key_views.RevokeKeyView.as_view(), name="key-revoke"),
    path("keys/<int:pk>/rotate/", key_views.RotateKeyView.as_view(), name="key-rotate"),
    path("data/overview/", views.OverviewData.as_view(), name="data-overview"),
    path("data/breakdown/", views.BreakdownData.as_view(), name="data-breakdown"),
    path("data/cache/", views.CacheData.as_view(), name="data-cache"),
    path("data/key-usage/", views.KeyUsageData.as_view(), name="data-key-usage"),
    path("vendor/plotly-<str:version>.min.js", vendor.plotly_js, name="plotly-js"),
]
