from __future__ import annotations

from django.db import models

from routing.contract import PARAMS_BY_ALGORITHM

# Routing algorithms a policy can use: exactly the contract's (names and labels from its params
# structs), so the control plane and the gateways cannot disagree. The ``policies.E001`` system
# check verifies the gateway's registry runs every one of them.
AlgorithmChoices = models.TextChoices(
    "AlgorithmChoices",
    [(name.upper(), (name, params.label)) for name, params in PARAMS_BY_ALGORITHM.items()],  # type: ignore[attr-defined]
)


class TuningOutcomeChoices(models.TextChoices):
    """What the online tuner decided at the end of a window (``policies.tuner_math``)."""

    MEASURED = "measured", "Measured the incumbent, trying a step"
    ACCEPTED = "accepted", "Accepted the step"
    REJECTED = "rejected", "Reverted the step"
    CONVERGED = "converged", "Converged"
