"""The policy page carries the shadows and canaries (issue 23) for policies.js to draw and follow live."""

from __future__ import annotations

import json
import re

import pytest

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
