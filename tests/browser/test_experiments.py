"""Shadow and canary on the policy page (issue 23), in a real Chromium against a real control plane.

The experiments are started through the policies layer (what the API calls) in a ``manage.py shell``
of the server's own database; their figures are what the workers' tick saves, and each save pushes
a ``policy.experiment`` message through the channel layer, which the open page must apply live.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser.conftest import DashboardServer
from tests.browser.test_dashboard import Session, operator_session  # noqa: F401  (a fixture)

pytestmark = pytest.mark.browser

START = """
from controlplane import audit
from controlplane.accounts import ensure_account
from controlplane.policies import experiments
from controlplane.policies.models import RoutingPolicy
user = ensure_account("operator").user
draft = RoutingPolicy.objects.create(name="no-rtt", algorithm="gorgo", params={"w_rtt": 0.0})
shadow = experiments.start("shadow", policy=draft, spec=experiments.trial_from_draft(draft), source_version=None, user=user)
canary = experiments.start("canary", policy=draft, spec=experiments.trial_from_draft(draft), source_version=None,
                           user=user, share_percent=10, limits=experiments.CanaryLimits(margin_ms=50, min_samples=30))
shadow.figures = {"regions": {"ap-south": {"shadow": {
    "requests": 200, "moved": 80, "cross_live": 10, "cross_shadow": 90, "moved_share": 0.4,
    "cross_region_share_live": 0.05, "cross_region_share_shadow": 0.45,
    "live_predicted_p50_ms": 120.0, "live_predicted_p99_ms": 400.0,
    "shadow_predicted_p50_ms": 260.0, "shadow_predicted_p99_ms": 900.0}}}}
shadow.save()
print(draft.pk, shadow.pk, canary.pk)
"""

# What a worker's tick saves for the canary: 12 answered requests each side, so not decided yet.
FIGURES = """
from controlplane.policies.models import PolicyExperiment
canary = PolicyExperiment.objects.get(pk={canary_id})
def arm(n, mean):
    return {{"requests": n, "errors": 0, "ttft_count": n, "ttft_sum_ms": n * mean, "ttft_sumsq_ms2": n * (mean * mean + 400)}}
canary.figures = {{"regions": {{"us-east": {{"live": arm({n}, 100.0), "canary": arm({n}, 300.0)}}}}}}
canary.save()
"""


def test_the_policy_page_shows_shadow_figures_and_follows_a_canary_live(
    operator_session: Session,  # noqa: F811  (the fixture of that name)
    server: DashboardServer,
    artifacts: Path,
) -> None:
    policy_id, shadow_id, canary_id = server.manage("shell", "-c", START).split()[-3:]
    page = operator_session.page
    operator_session.open(f"/policies/{policy_id}/")
    shadow = page.locator(f'[data-experiment-id="{shadow_id}"]')
    figures = shadow.locator("[data-testid=shadow-figures] tbody tr").first
    figures.wait_for()
    assert figures.locator("td").all_inner_texts() == [
        "ap-south",
        "200",
        "40.0 %",
        "5.0 % → 45.0 %",
        "120 ms / 260 ms",
        "400 ms / 900 ms",
    ]
    canary = page.locator(f'[data-experiment-id="{canary_id}"]')
    assert (
        "canary" in canary.locator("h3").inner_text()
        and "10 % of sessions" in canary.locator("h3").inner_text()
    )
    operator_session.wait_live()
    page.evaluate("window.__notReloaded = true")

    server.manage("shell", "-c", FIGURES.format(canary_id=canary_id, n=12))
    row = canary.locator("[data-testid=canary-comparison] tbody tr").first
    row.locator("td", has_text="collecting samples").wait_for(timeout=10_000)
    assert row.locator("td").nth(1).inner_text() == "12 / 12"
    assert row.locator("td").nth(2).inner_text() == "300 ms / 100 ms"

    server.manage("shell", "-c", FIGURES.format(canary_id=canary_id, n=60))
    worse = row.locator("td", has_text="worse by more than the margin")
    worse.wait_for(timeout=10_000)
    assert worse.get_attribute("title").startswith("TTFT +200.0 ms against the rest")
    low = row.locator("td").nth(3).inner_text()
    assert low.startswith("+200.0 ms [+")  # the always-valid interval, above the margin
    assert page.evaluate("window.__notReloaded") is True
    operator_session.shot(artifacts, "policy-experiments")
