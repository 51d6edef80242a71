from __future__ import annotations

from django.db import models


class PriorityChoices(models.TextChoices):
    """A key's priority class: when every node is full, interactive requests are queued first."""

    INTERACTIVE = "interactive", "Interactive"
    BATCH = "batch", "Batch"
