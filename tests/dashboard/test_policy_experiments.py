"""The policy page carries the shadows and canaries (issue 23) for policies.js to draw and follow live."""

from __future__ import annotations

import json
import re

import pytest
from django.test import Client

from controlplane.policies import experiments, publishing
from controlplane.policies.models import RoutingPolicy

pytestmark = pytest.mark.django_db


def test_the_detail_page_carries_running_and_recent_experiments(
    viewer_client, operator, policy: RoutingPolicy
) -> None:
    publishing.publish(policy)
    draft = RoutingPolicy.objects.create(name="draft", algorithm="least_load")
    spec = experiments.trial_from_draft(draft)
    shadow = experiments.start("shadow", policy=draft, spec=spec, source_version=None, user=operator.user)
    shadow.figures = {
        "regions": {"us-east": {"shadow": {"requests": 3, "moved_share": 0.5, "x_histogram": {"1": 3}}}}
    }
    shadow.save()
    canary = experiments.start(
        "canary", policy=draft, spec=spec, source_version=None, user=operator.user, share_percent=5
    )
    page = viewer_client.get(f"/policies/{policy.pk}/").content.decode()
    data = json.loads(
        re.search(r'<script id="gorgo-experiments" type="application/json">(.*?)</script>', page).group(1)
    )
    assert [(e["id"], e["kind"], e["status"]) for e in data] == [
        (canary.pk, "canary", "running"),
        (shadow.pk, "shadow", "running"),
    ]
    assert data[1]["regions"] == {"us-east": {"shadow": {"requests": 3, "moved_share": 0.5}}}
    assert 'data-testid="experiments"' in page


def test_only_who_may_publish_gets_the_stop_and_promote_buttons(
    viewer_client, operator_client, policy: RoutingPolicy
) -> None:
    publishing.publish(policy)
    section = r'<section class="panel" id="experiments"[^>]*>'
    operator_page = operator_client.get(f"/policies/{policy.pk}/").content.decode()
    viewer_page = viewer_client.get(f"/policies/{policy.pk}/").content.decode()
    assert "data-can-publish" in re.search(section, operator_page).group(0)
    assert "data-can-publish" not in re.search(section, viewer_page).group(0)


def test_the_pages_stop_button_goes_through_the_api_with_the_session_and_its_csrf_token(
    operator, viewer, policy: RoutingPolicy
) -> None:
    publishing.publish(policy)
    draft = RoutingPolicy.objects.create(name="draft", algorithm="least_load")
    shadow = experiments.start(
        "shadow",
        policy=draft,
        spec=experiments.trial_from_draft(draft),
        source_version=None,
        user=operator.user,
    )
    url = f"/api/v1/policy-experiments/{shadow.pk}/stop/"
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(viewer.user)
    browser.get(f"/policies/{policy.pk}/")  # sets the CSRF cookie
    token = browser.cookies["csrftoken"].value
    refused = browser.post(url, "{}", content_type="application/json", headers={"X-CSRFToken": token})
    assert refused.status_code == 403  # a viewer may not, whatever the page shows

    browser.force_login(operator.user)
    page = browser.get(f"/policies/{policy.pk}/").content.decode()
    token = re.search(r'id="experiments".*?name="csrfmiddlewaretoken" value="([^"]+)"', page, re.S).group(1)
    assert browser.post(url, "{}", content_type="application/json").status_code == 403  # no token: CSRF
    stopped = browser.post(url, "{}", content_type="application/json", headers={"X-CSRFToken": token})
    assert stopped.status_code == 200, stopped.content
    assert stopped.json()["status"] == "stopped"
    again = browser.post(url, "{}", content_type="application/json", headers={"X-CSRFToken": token})
    assert again.status_code == 409
    assert again.json()["detail"] == f"Shadow #{shadow.pk} (draft draft) is not running (it is stopped)."
