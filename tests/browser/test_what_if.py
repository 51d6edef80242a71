"""The policy page's what-if panel in a real Chromium: replay recent traffic, see both distributions.

A control plane of its own, whose Celery tasks run in the web process (``CELERY_TASK_ALWAYS_EAGER``:
no worker in this test), with 600 request records in the request log as the gateways write them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.conftest import OPERATOR, VIEWER, DashboardServer, seeded_server
from tests.browser.test_dashboard import Session

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def what_if_server(chromium: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DashboardServer]:
    plane = seeded_server(tmp_path_factory.mktemp("what-if"), CELERY_TASK_ALWAYS_EAGER="true")
    plane.run("-m", "tests.browser.demo_data", "--minutes", "1", "--requests", "600")
    yield plane
    plane.group.stop_all()


def test_it_replays_the_window_and_shows_the_live_and_the_draft_distribution(
    browser, what_if_server: DashboardServer, artifacts: Path
) -> None:
    session = Session(browser, what_if_server, OPERATOR)
    page = session.page
    session.open("/policies/")
    page.click("#policy-table >> text=default")
    # A draft that ignores the network: the replay should show it slower than live.
    page.click("#edit-policy")
    page.fill("#id_param_gorgo_w_rtt", "0")
    page.click("text=Save draft")
    page.wait_for_selector("#diff")
    page.fill("#what-if-minutes", "10")
    page.click("#what-if-run")
    session.charts_drawn("what-if-cdf", "what-if-histogram")
    rows = page.locator("#what-if-table tbody tr")
    assert rows.count() == 3
    assert [rows.nth(i).get_attribute("data-series") for i in range(3)] == ["measured", "live", "draft"]
    assert "600 requests replayed" in page.inner_text("#what-if-status")
    traces = page.evaluate("document.getElementById('what-if-cdf').data.map(t => [t.name, t.x.length])")
    assert len(traces) == 3 and all(points > 10 for _name, points in traces)
    assert "(replayed)" in traces[1][0] and traces[2][0] == "this policy (replayed)"
    session.shot(artifacts, "policy-what-if")
    session.close()


HOSTILE_NAME = 'default <img src=x onerror="window.pwned=1">'


def test_a_policy_named_with_html_is_shown_as_text_in_the_replay_table(
    browser, what_if_server: DashboardServer
) -> None:
    # Policy names are free text typed by operators; the table names the live policy by its name.
    # Any signed-in user may run a replay, so markup in that name ran in the viewer's browser.
    rename = "from controlplane.policies.models import RoutingPolicy; RoutingPolicy.objects.filter(is_active=True).update(name={!r})"
    what_if_server.manage("shell", "-c", rename.format(HOSTILE_NAME))
    try:
        session = Session(browser, what_if_server, VIEWER)
        page = session.page
        session.open("/policies/")
        page.click("#policy-table th a")
        page.fill("#what-if-minutes", "10")
        page.click("#what-if-run")
        session.charts_drawn("what-if-cdf")
        live_row = page.locator('#what-if-table tr[data-series="live"] td').first
        assert HOSTILE_NAME in live_row.inner_text()
        assert page.evaluate(
            "document.querySelector('#what-if-table img') === null && window.pwned === undefined"
        )
        legend = page.evaluate("document.getElementById('what-if-cdf').data[1].name")
        assert HOSTILE_NAME not in legend  # escaped for Plotly, which renders names as HTML
        session.close()
    finally:
        what_if_server.manage("shell", "-c", rename.format("default"))


def test_it_says_so_when_the_window_holds_no_traffic(browser, what_if_server: DashboardServer) -> None:
    forget_requests = "from controlplane.connections import redis_client, redis_keys; redis_client().delete(redis_keys().request_stream)"
    what_if_server.manage("shell", "-c", forget_requests)
    session = Session(browser, what_if_server, OPERATOR)
    page = session.page
    session.open("/policies/")
    page.click("#policy-table >> text=default")
    page.fill("#what-if-minutes", "10")
    page.click("#what-if-run")
    page.wait_for_function("document.getElementById('what-if-status').classList.contains('bad')")
    assert "no request from the last 10 minute(s)" in page.inner_text("#what-if-status")
    assert page.is_visible("#what-if-cdf-empty")
    assert "no request from the last 10 minute(s)" in page.inner_text("#what-if-cdf-empty")
    session.close()
