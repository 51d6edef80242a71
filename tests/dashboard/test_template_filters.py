"""Template filters: compact relative times and diff values."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from controlplane.dashboard.templatetags.gorgo import ago, compact_json


def test_it_says_how_long_ago_in_few_characters() -> None:
    now = timezone.now()
    assert ago(now - timedelta(seconds=20)) == "just now"
    assert ago(now - timedelta(minutes=12)) == "12 min ago"
    assert ago(now - timedelta(hours=3)) == "3 h ago"
    assert ago(now - timedelta(days=2)) == "2 d ago"
    assert ago(None) == "—"


def test_it_prints_diff_values_as_short_json() -> None:
    assert compact_json(None) == "—"
    assert compact_json("draining") == "draining"
    assert compact_json({"b": [1, 2], "a": 1.5}) == '{"a": 1.5, "b": [1, 2]}'
