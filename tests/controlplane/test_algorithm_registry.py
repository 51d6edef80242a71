"""One algorithm registry: the contract's params structs name the algorithms, the rest follows."""

from __future__ import annotations

from dataclasses import replace

from django.core import checks

from controlplane.policies.checks import algorithm_registry_errors
from controlplane.policies.choices import AlgorithmChoices
from routing.algorithms import REGISTRY
from routing.contract import ALGORITHMS, PARAMS_BY_ALGORITHM, algorithm_name


def test_it_derives_every_list_of_algorithms_from_the_contract() -> None:
    assert tuple(PARAMS_BY_ALGORITHM) == ALGORITHMS
    assert all(algorithm_name(params) == name for name, params in PARAMS_BY_ALGORITHM.items())
    assert set(REGISTRY) == set(ALGORITHMS)
    assert all(REGISTRY[name].params is PARAMS_BY_ALGORITHM[name] for name in ALGORITHMS)
    assert tuple(AlgorithmChoices.values) == tuple(REGISTRY)


def test_it_passes_the_system_check() -> None:
    assert [m for m in checks.run_checks() if m.id and m.id.startswith("policies.")] == []


def test_it_reports_a_registry_that_lacks_an_algorithm() -> None:
    registry = {name: info for name, info in REGISTRY.items() if name != "gorgo"}

    (error,) = algorithm_registry_errors(registry, ALGORITHMS)

    assert error.id == "policies.E001" and "gorgo" in error.msg


def test_it_reports_an_algorithm_the_contract_lacks() -> None:
    (error,) = algorithm_registry_errors(REGISTRY, [name for name in ALGORITHMS if name != "least_load"])

    assert error.id == "policies.E002" and "least_load" in error.msg


def test_it_reports_a_registry_key_that_is_not_the_algorithms_name() -> None:
    registry = {**REGISTRY, "gorgo": replace(REGISTRY["round_robin"])}
    errors = algorithm_registry_errors(registry, ALGORITHMS)

    assert [e.id for e in errors] == ["policies.E003"]
