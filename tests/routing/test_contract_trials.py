"""The snapshot's shadow and canary (issue 23) are an additive contract change."""

from __future__ import annotations

import msgspec

from routing import contract
from routing.contract import GorgoParams, PolicySnapshot, PolicySpec, TrialSpec, decode_trial, encode_trial


def _snapshot(**trials: msgspec.Raw) -> PolicySnapshot:
    return PolicySnapshot(
        schema_version=contract.SCHEMA_VERSION,
        version=3,
        checksum="c",
        published_at=1.0,
        policy=PolicySpec(id=1, name="live", algorithm="gorgo", params=GorgoParams()),
        regions=(),
        models=(),
        nodes=(),
        **trials,
    )


class _SnapshotBeforeTrials(msgspec.Struct, frozen=True):
    """The snapshot as gateways built before issue 23 read it."""

    schema_version: int
    version: int
    checksum: str
    published_at: float
    policy: PolicySpec
    regions: tuple
    models: tuple
    nodes: tuple


def test_it_leaves_a_snapshot_without_trials_as_it_was() -> None:
    assert b"shadow" not in contract.encode(_snapshot()) and b"canary" not in contract.encode(_snapshot())


def test_it_lets_gateways_built_before_trials_read_a_snapshot_with_them() -> None:
    trial = TrialSpec(
        id=7,
        kind="canary",
        policy=PolicySpec(id=2, name="new", algorithm="least_load", params=contract.LeastLoadParams()),
        share=0.1,
        salt="s",
    )
    data = contract.encode(_snapshot(canary=encode_trial(trial)))
    old = msgspec.json.decode(data, type=_SnapshotBeforeTrials)
    assert (old.version, old.policy.name) == (3, "live")
    assert decode_trial(contract.decode(data, PolicySnapshot).canary) == trial


def test_it_keeps_an_unreadable_trial_apart_from_the_live_policy() -> None:
    # A trial naming an algorithm this build does not have: the snapshot still decodes.
    raw = msgspec.Raw(
        b'{"id":1,"kind":"shadow","policy":{"id":2,"name":"x","algorithm":"future","params":{"type":"future"}}}'
    )
    snapshot = contract.decode(contract.encode(_snapshot(shadow=raw)), PolicySnapshot)
    assert snapshot.policy.name == "live"
    try:
        decode_trial(snapshot.shadow)
    except msgspec.ValidationError:
        pass
    else:
        raise AssertionError("an unknown algorithm must not decode")
