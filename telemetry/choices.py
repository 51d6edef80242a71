"""Enumerations of the telemetry app."""

from __future__ import annotations

from django.db import models


class HealthChoices(models.TextChoices):
    """Measured health of a node (operator state lives on ``Node.state``)."""

    UNKNOWN = "unknown", "Unknown"
    HEALTHY = "healthy", "Healthy"
    UNHEALTHY = "unhealthy", "Unhealthy"


class CheckChoices(models.TextChoices):
    """The kinds of check whose outcomes drive health."""

    PROBE = "probe", "RTT probe (GET /health)"
    SCRAPE = "scrape", "Metrics scrape (GET /metrics)"


class ResolutionChoices(models.TextChoices):
    """Width of a request-aggregate bucket."""

    TEN_SECONDS = "10s", "10 seconds"
    ONE_MINUTE = "1m", "1 minute"


RESOLUTION_SECONDS: dict[str, int] = {ResolutionChoices.TEN_SECONDS: 10, ResolutionChoices.ONE_MINUTE: 60}


class ScopeChoices(models.TextChoices):
    """What a request-aggregate bucket groups by."""

    NODE = "node", "Node"
    REGION = "region", "Gateway region"
    # A gateway region's requests split by where they were served (the breakdown shows both
    # where a region uses both: a cross-region request pays the network, a local one rarely).
    LOCAL = "local", "Gateway region, served in the same region"
    CROSS = "cross", "Gateway region, served from another region"
