"""Shadow and canary on the policy page (issue 23), in a real Chromium against a real control plane.

The experiments are started through the policies layer (what the API calls) in a ``manage.py shell``
of the server's own database; their figures are what the workers' tick saves, and each save pushes
a ``policy.experiment`` message through the channel layer, which the open page must apply live.
The page's stop and promote buttons go through the API (its permission check and audit: one code
path), confirmed first; what they did is read back from the API.
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

# Another operator ended it and this page missed the push (a queryset update sends none).
SET_STATUS = """
from controlplane.policies.models import PolicyExperiment
PolicyExperiment.objects.filter(pk={pk}).update(status="{status}")
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

    # Stop the shadow from the page: nothing happens until the operator confirms.
    page.once("dialog", lambda dialog: dialog.dismiss())
    shadow.locator("[data-testid=experiment-stop]").click()
    assert shadow.get_attribute("data-status") == "running"
    messages: list[str] = []
    page.once("dialog", lambda dialog: (messages.append(dialog.message), dialog.accept()))
    shadow.locator("[data-testid=experiment-stop]").click()
    page.locator(f'[data-experiment-id="{shadow_id}"][data-status="stopped"]').wait_for(timeout=10_000)
    assert messages and messages[0].startswith(f"Stop shadow #{shadow_id}?")
    assert shadow.locator("[data-testid=experiment-stop]").count() == 0  # nothing left to stop
    stopped = api_get(page, server, shadow_id)
    assert (stopped["status"], stopped["ended_version"] is not None) == ("stopped", True)

    # Promoting a canary that was stopped elsewhere: the API's 409, said on the page.
    server.manage("shell", "-c", SET_STATUS.format(pk=canary_id, status="stopped"))
    page.once("dialog", lambda dialog: dialog.accept())
    canary.locator("[data-testid=experiment-promote]").click()
    error = canary.locator("[data-testid=experiment-error]")
    error.wait_for(timeout=10_000)
    assert error.inner_text() == (
        f"Could not promote canary #{canary_id}: "
        f"Canary #{canary_id} (no-rtt draft at 10 %) is not running (it is stopped)."
    )
    server.manage("shell", "-c", SET_STATUS.format(pk=canary_id, status="running"))

    # Promote it: the trial is published as the live policy, and the experiment ends in that version.
    page.once("dialog", lambda dialog: dialog.accept())
    canary.locator("[data-testid=experiment-promote]").click()
    page.locator(f'[data-experiment-id="{canary_id}"][data-status="promoted"]').wait_for(timeout=10_000)
    assert canary.locator("[data-testid=experiment-error]").count() == 0
    promoted = api_get(page, server, canary_id)
    assert (promoted["status"], promoted["ended_version"] is not None) == ("promoted", True)

    # Usable at 1,024 px: nothing wider than the window.
    page.set_viewport_size({"width": 1024, "height": 800})
    assert page.evaluate("document.documentElement.scrollWidth") <= 1024
    operator_session.shot(artifacts, "policy-experiments-ended")


def api_get(page, server: DashboardServer, experiment_id: str) -> dict:
    """The experiment as the API shows it, asked with the page's session."""
    response = page.request.get(f"{server.url}/api/v1/policy-experiments/{experiment_id}/")
    assert response.ok, response.text()
    return response.json()
