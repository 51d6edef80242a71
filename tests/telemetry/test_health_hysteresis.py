"""Health: N failures -> unhealthy, M successes -> healthy, compare-and-swap, events, live state."""

from __future__ import annotations

import pytest

from routing import contract
from routing.contract import NodeLiveState
from telemetry import health, rounds
from telemetry.choices import CheckChoices, HealthChoices
from telemetry.health import Outcome, Streak, Thresholds, decide
from telemetry.live import merge_node_live
from telemetry.models import HealthEvent, NodeHealth
from tests.telemetry.conftest import make_node, make_regions

DEFAULT = Thresholds(failures=3, successes=2)


class TestDecide:
    def test_it_waits_for_n_consecutive_failures(self):
        assert decide({"probe": Streak(failures=2)}, DEFAULT) is None
        assert decide({"probe": Streak(failures=3)}, DEFAULT) == HealthChoices.UNHEALTHY

    def test_it_needs_m_successes_of_every_check_seen(self):
        assert decide({"probe": Streak(successes=1)}, DEFAULT) is None
        assert decide({"probe": Streak(successes=2)}, DEFAULT) == HealthChoices.HEALTHY
        assert decide({"probe": Streak(successes=5), "scrape": Streak(successes=1)}, DEFAULT) is None

    def test_any_failing_check_wins(self):
        assert decide({"probe": Streak(successes=9), "scrape": Streak(failures=3)}, DEFAULT) == "unhealthy"


@pytest.mark.django_db
class TestTransitions:
    @pytest.fixture
    def node(self, tel):
        return make_node("use-1", make_regions("us-east")["us-east"], "http://127.0.0.1:1")

    def run(self, tel, node, *oks: bool, check: str = CheckChoices.PROBE) -> list[health.Transition]:
        transitions = []
        for ok in oks:
            transitions += rounds.settle(
                tel.client,
                tel.keys,
                check,
                [Outcome(node.pk, ok, "" if ok else "ConnectError: refused")],
                {},
                healthy_default={},
                announce=False,
                thresholds=DEFAULT,
            )
        return transitions

    def live(self, tel, node) -> NodeLiveState:
        return contract.decode(tel.client.hget(tel.keys.live_nodes, str(node.pk)), NodeLiveState)

    def test_it_turns_unhealthy_after_three_failures_and_healthy_after_two_successes(self, tel, node):
        assert self.run(tel, node, True, True)[0].current == "healthy"
        assert self.run(tel, node, False, False) == []
        assert NodeHealth.objects.get(node=node).health == "healthy"

        (down,) = self.run(tel, node, False)
        assert (down.previous, down.current) == ("healthy", "unhealthy")
        assert self.live(tel, node).healthy is False
        assert self.run(tel, node, True) == []  # one success is not enough
        (up,) = self.run(tel, node, True)
        assert (up.previous, up.current) == ("unhealthy", "healthy")
        assert self.live(tel, node).healthy is True

    def test_a_success_resets_the_failure_streak(self, tel, node):
        self.run(tel, node, True, True, False, False, True, False, False)

        assert NodeHealth.objects.get(node=node).health == "healthy"

    def test_it_logs_each_transition_with_a_timestamp_and_reason(self, tel, node):
        self.run(tel, node, False, False, False, True, True)

        events = list(HealthEvent.objects.filter(node=node).order_by("ts", "id"))
        assert [(e.previous, e.current) for e in events] == [
            ("unknown", "unhealthy"),
            ("unhealthy", "healthy"),
        ]
        assert events[0].ts <= events[1].ts
        assert "3 consecutive failed probes" in events[0].reason
        assert "ConnectError" in events[0].reason

    def test_failing_scrapes_alone_make_a_node_unhealthy(self, tel, node):
        self.run(tel, node, True, True, True)
        self.run(tel, node, False, False, False, check=CheckChoices.SCRAPE)

        assert NodeHealth.objects.get(node=node).health == "unhealthy"
        # Probes keep succeeding, but the scrape streak is still failing: no way back yet.
        assert self.run(tel, node, True, True) == []
        self.run(tel, node, True, True, check=CheckChoices.SCRAPE)
        assert NodeHealth.objects.get(node=node).health == "healthy"

    def test_only_one_of_two_racing_workers_records_the_transition(self, tel, node):
        row = NodeHealth.objects.create(node=node, health="healthy")
        stale_copy = NodeHealth.objects.get(pk=row.pk)

        first = health.apply_transition(row, "unhealthy", "probe", "down")
        second = health.apply_transition(stale_copy, "unhealthy", "scrape", "down")

        assert first is not None and second is None
        assert HealthEvent.objects.filter(node=node).count() == 1

    def test_it_announces_the_change_to_the_gateways(self, tel, node):
        pubsub = tel.client.pubsub()
        pubsub.subscribe(tel.keys.live_channel)
        pubsub.get_message(timeout=1.0)

        self.run(tel, node, False, False, False)

        message = pubsub.get_message(timeout=2.0)
        pubsub.close()
        assert message is not None and message["data"] == tel.keys.live_nodes.encode()
        assert self.live(tel, node).healthy is False

    def test_it_keeps_the_other_live_fields_when_flipping_healthy(self, tel, node):
        merge_node_live(
            tel.client, tel.keys, {node.pk: {"num_running": 7.0, "prefix_hit_rate": 0.5}}, healthy_default={}
        )

        self.run(tel, node, False, False, False)

        live = self.live(tel, node)
        assert (live.healthy, live.num_running, live.prefix_hit_rate) == (False, 7.0, 0.5)
