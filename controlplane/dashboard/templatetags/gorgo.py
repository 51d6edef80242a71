"""Template filters of the dashboard."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django import template
from django.utils import timezone

register = template.Library()


@register.filter
def compact_json(value: Any) -> str:
    """A diff value as short JSON (``—`` when a side lacks it)."""
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(", ", ": "), sort_keys=True, default=str)


@register.filter
def ago(value: datetime | None) -> str:
    """Compact relative time: "just now", "12 min ago", "3 h ago", "2 d ago"."""
    if value is None:
        return "—"
    seconds = (timezone.now() - value).total_seconds()
    if seconds < 60:
        return "just now"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min ago"
    if seconds < 36 * 3600:
        return f"{round(seconds / 3600)} h ago"
    return f"{round(seconds / 86400)} d ago"
