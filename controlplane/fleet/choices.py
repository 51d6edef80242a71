from __future__ import annotations

from django.db import models


class NodeStateChoices(models.TextChoices):
    """Operator-set state of a node. Health is measured separately by telemetry."""

    ACTIVE = "active", "Active"
    DRAINING = "draining", "Draining"
    DISABLED = "disabled", "Disabled"
