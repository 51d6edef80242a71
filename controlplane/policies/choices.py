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


class ExperimentKindChoices(models.TextChoices):
    """How a policy runs beside the live one (issue 23; ``routing.contract.TrialSpec``)."""

    SHADOW = "shadow", "Shadow (decides, serves nothing)"
    CANARY = "canary", "Canary (serves a share of sessions)"


class ExperimentStatusChoices(models.TextChoices):
    """Where an experiment is; only ``running`` ones are in the published snapshot."""

    RUNNING = "running", "Running"
    STOPPED = "stopped", "Stopped"
    PROMOTED = "promoted", "Promoted (published as the live policy)"
    ROLLED_BACK = "rolled_back", "Rolled back automatically"
