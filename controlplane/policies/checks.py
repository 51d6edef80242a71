"""System checks of the policies app (``manage.py check`` and every server start run them)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.core import checks

from routing.contract import ALGORITHMS
from routing.writer import GATEWAY_ALGORITHMS


def algorithm_registry_errors(
    registry: Mapping[str, Any], algorithms: Iterable[str]
) -> list[checks.CheckMessage]:
    """Errors when the gateway's registry (name -> anything with the ``name`` its params give it)
    and the contract's algorithms disagree."""
    algorithms = set(algorithms)
    errors: list[checks.CheckMessage] = []
    missing = sorted(algorithms - set(registry))
    if missing:
        errors.append(
            checks.Error(
                f"routing.algorithms.REGISTRY has no function for: {', '.join(missing)}",
                hint="Add the algorithm module's INFO to REGISTRY in routing/algorithms/__init__.py.",
                id="policies.E001",
            )
        )
    unknown = sorted(set(registry) - algorithms)
    if unknown:
        errors.append(
            checks.Error(
                f"routing.algorithms.REGISTRY has algorithms the contract does not: {', '.join(unknown)}",
                hint="Add the params struct to AlgorithmParams in routing/contract.py.",
                id="policies.E002",
            )
        )
    misnamed = sorted(key for key, info in registry.items() if key != info.name)
    if misnamed:
        errors.append(
            checks.Error(
                f"routing.algorithms.REGISTRY keys differ from their params' tags: {', '.join(misnamed)}",
                id="policies.E003",
            )
        )
    return errors


def check_algorithm_registry(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    return algorithm_registry_errors(GATEWAY_ALGORITHMS, ALGORITHMS)
