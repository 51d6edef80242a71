"""The policy pages show online tuning: the switch in the editor, the windows on the detail page."""

from __future__ import annotations

import pytest
from django.utils import timezone

from controlplane.policies.models import RoutingPolicy, TuningWindow

pytestmark = pytest.mark.django_db


def test_the_detail_page_lists_the_tuners_windows(viewer_client, policy: RoutingPolicy) -> None:
    RoutingPolicy.objects.filter(pk=policy.pk).update(auto_tune=True)
    now = timezone.now()
    TuningWindow.objects.create(
        policy=policy,
        started_at=now,
        ended_at=now,
        w_rtt=1.25,
        w_queue=0.875,
        p95_ms=412.0,
        requests=350,
        outcome="accepted",
        sigma=0.3,
        note="tuner: accepted w_rtt=1.25, w_queue=0.875",
    )
    page = viewer_client.get(f"/policies/{policy.pk}/").content.decode()
    assert 'data-testid="tuning-windows"' in page
    assert "1.250" in page and "0.875" in page and "412" in page and "Accepted the step" in page
    assert "on: the tuner moves w_rtt and w_queue" in page


def test_the_editor_switches_tuning_on(operator_client, policy: RoutingPolicy) -> None:
    page = operator_client.get(f"/policies/{policy.pk}/edit/").content.decode()
    assert 'name="auto_tune"' in page and "Online tuning" in page
