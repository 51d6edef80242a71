"""The wire contract: round trips, schema-version refusal, parameter validation, no Django."""

from __future__ import annotations

import msgspec
import pytest

from routing import contract
from routing.contract import (
    GorgoParams,
    NodeSpec,
    PolicySnapshot,
    PolicySpec,
    RedisKeys,
    RegionSpec,
    UnknownSchemaVersion,
)


def snapshot(**overrides) -> PolicySnapshot:
    fields = dict(
        schema_version=contract.SCHEMA_VERSION,
        version=7,
        checksum="abc",
        published_at=1.0,
        policy=PolicySpec(id=1, name="default", algorithm="gorgo", params=GorgoParams(w_rtt=2.0)),
        regions=(RegionSpec(slug="us-east", name="US East", latitude=39.04, longitude=-77.49),),
        models=(),
        nodes=(
            NodeSpec(
                id=1,
                name="us-east-1",
                region="us-east",
                base_url="http://127.0.0.1:8101",
                models=("m",),
                gpu_type="H100",
                gpu_count=1,
                max_num_seqs=256,
                prefill_tokens_per_s=20000.0,
                kv_capacity_tokens=500000,
                state="active",
            ),
        ),
    )
    fields.update(overrides)
    return PolicySnapshot(**fields)


def test_it_round_trips_a_snapshot_with_tagged_params() -> None:
    decoded = contract.decode(contract.encode(snapshot()), PolicySnapshot)
    assert decoded == snapshot()
    assert isinstance(decoded.policy.params, GorgoParams)
    assert decoded.policy.params.w_rtt == 2.0


def test_it_refuses_an_unknown_schema_version() -> None:
    data = contract.encode(snapshot(schema_version=contract.SCHEMA_VERSION + 1))
    with pytest.raises(UnknownSchemaVersion, match="schema_version"):
        contract.decode(data, PolicySnapshot)


def test_it_rejects_out_of_range_params() -> None:
    with pytest.raises(msgspec.ValidationError, match="w_queue"):
        msgspec.convert({"w_queue": -1}, GorgoParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"unknown": 1}, GorgoParams)


def test_it_namespaces_every_redis_name() -> None:
    keys = RedisKeys(prefix="staging")
    names = [getattr(keys, name) for name in dir(RedisKeys) if isinstance(getattr(RedisKeys, name), property)]
    assert names and all(name.startswith("staging") for name in names)
    assert len(set(names)) == len(names)


class TestParamsErrors:
    """Why parameters are invalid, per parameter, in words an operator reads (no msgspec text)."""

    def test_it_names_every_bad_parameter_with_its_problem(self) -> None:
        errors = contract.params_errors("gorgo", {"w_rtt": 101, "w_queue": "fast", "bogus": 1})
        assert errors == {
            "w_rtt": "Must be at most 100.",
            "w_queue": "Must be a number.",
            "bogus": "Not a parameter of gorgo (its parameters: w_rtt, w_queue, default_rtt_ms, chars_per_token, w_displacement, homing_rent_ratio, measured_inputs).",
        }

    def test_it_explains_bounds_whole_numbers_lengths_and_patterns(self) -> None:
        assert contract.params_errors("session_affinity", {"virtual_nodes": 0}) == {
            "virtual_nodes": "Must be at least 1."
        }
        assert contract.params_errors("session_affinity", {"virtual_nodes": 1.5}) == {
            "virtual_nodes": "Must be a whole number."
        }
        assert contract.params_errors("session_affinity", {"session_header": ""}) == {
            "session_header": "Must be 1 to 100 characters long."
        }
        assert contract.params_errors("session_affinity", {"session_header": "bad header!"}) == {
            "session_header": "Use letters, digits and hyphens only."
        }

    def test_it_reports_a_non_object_as_a_whole(self) -> None:
        assert contract.params_errors("gorgo", [1, 2]) == {
            contract.WHOLE_PARAMS: "Parameters must be a JSON object."
        }

    def test_it_accepts_what_the_params_struct_accepts(self) -> None:
        assert contract.params_errors("gorgo", {"w_rtt": 2, "type": "gorgo"}) == {}
        assert contract.params_errors("round_robin", {}) == {}
