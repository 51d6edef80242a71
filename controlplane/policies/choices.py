from __future__ import annotations

from django.db import models

from routing.contract import ALGORITHMS


class AlgorithmChoices(models.TextChoices):
    """Routing algorithms a policy can use (the gateway's registry has one function for each)."""

    ROUND_ROBIN = "round_robin", "Round robin"
    LEAST_LOAD = "least_load", "Least load"
    SESSION_AFFINITY = "session_affinity", "Session affinity"
    PREFIX_AFFINITY = "prefix_affinity", "Prefix affinity (cache-aware)"
    GORGO = "gorgo", "GORGO (network + queue + cache)"


assert set(AlgorithmChoices.values) == set(ALGORITHMS), "choices and the contract must agree"
