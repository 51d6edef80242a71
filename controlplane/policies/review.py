"""Look at a compiled snapshot before publishing it: a summary, and its changes against the live one.

``review_policy`` is the one answer the REST API (``validate``, ``diff``) and the policy page give.
Everything here reads the database only (the live snapshot is the newest published
``PolicyVersion``), so a dry run works, and writes nothing, even when Redis is down.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, get_args

import msgspec

from controlplane.policies import publishing
from controlplane.policies.models import PolicyVersion, RoutingPolicy
from routing import contract
from routing.contract import NodeState, PolicySnapshot

# Collections compared by a stable key, so removing one node shows as one removal, not a shift.
_KEYED_COLLECTIONS = {"regions": "slug", "models": "name", "nodes": "name"}
# Differ on every publish by construction; the checksum already says whether anything else did.
_PUBLISH_FIELDS = ("version", "checksum", "published_at")
_ABSENT = object()


@dataclass(frozen=True, slots=True)
class SnapshotChange:
    """One changed value: ``path`` like ``nodes[us-east-1].state``; None where a side lacks it."""

    path: str
    old: Any
    new: Any


@dataclass(frozen=True, slots=True)
class PolicyReview:
    """A policy compiled with the current fleet, beside the version the gateways run now."""

    policy_id: int
    snapshot: PolicySnapshot
    live: PolicyVersion | None
    changes: list[SnapshotChange]
    summary: dict[str, Any]

    @property
    def checksum(self) -> str:
        return self.snapshot.checksum

    @property
    def differs_from_live(self) -> bool:
        return self.live is None or self.live.checksum != self.snapshot.checksum

    @property
    def is_live(self) -> bool:
        """This policy, compiled now, is exactly what the gateways run."""
        return not self.differs_from_live and self.live.policy_id == self.policy_id


def review_policy(policy: RoutingPolicy) -> PolicyReview:
    """Compile ``policy`` with the current fleet and compare it with the live version.

    Raises ``ValidationError`` when the policy does not compile; callers answer that their way.
    """
    snapshot = publishing.compile_policy(policy)
    live = publishing.live_version()
    return PolicyReview(
        policy_id=policy.pk,
        snapshot=snapshot,
        live=live,
        changes=diff_snapshots(live.compiled() if live else None, snapshot),
        summary=summarize(snapshot),
    )


def summarize(snapshot: PolicySnapshot) -> dict[str, Any]:
    """What a snapshot would make the gateways do, in a few lines."""
    policy = snapshot.policy
    params = msgspec.to_builtins(policy.params)
    params.pop("type", None)  # the union tag repeats the algorithm
    scope = set(policy.model_scope) or {m.name for m in snapshot.models}
    states = Counter(n.state for n in snapshot.nodes)
    return {
        "policy": policy.name,
        "algorithm": policy.algorithm,
        "params": params,
        "model_scope": list(policy.model_scope),
        "residency": msgspec.to_builtins(policy.residency),
        "max_rtt_ms": policy.max_rtt_ms,
        "regions": [r.slug for r in snapshot.regions],
        "models": [m.name for m in snapshot.models],
        "nodes": {"total": len(snapshot.nodes), **{state: states[state] for state in get_args(NodeState)}},
        "routable_nodes": sorted(
            n.name for n in snapshot.nodes if n.state == "active" and scope.intersection(n.models)
        ),
    }


def diff_snapshots(old: PolicySnapshot | None, new: PolicySnapshot) -> list[SnapshotChange]:
    """Every value that differs between two snapshots, ignoring version, checksum and time."""
    changes: list[SnapshotChange] = []
    _diff(_comparable(old) if old is not None else {}, _comparable(new), "", changes)
    return changes


def _comparable(snapshot: PolicySnapshot) -> dict[str, Any]:
    # Through JSON, not to_builtins: the shadow and canary are raw JSON inside the snapshot, and
    # their changes (a trial started, its share) belong in the diff too.
    doc = msgspec.json.decode(contract.encode(snapshot))
    for name in _PUBLISH_FIELDS:
        doc.pop(name, None)
    for name, key in _KEYED_COLLECTIONS.items():
        doc[name] = _Keyed({item[key]: item for item in doc[name]})
    return doc


class _Keyed(dict):
    """A list turned into a dict by key; its members print as ``name[key]`` in paths."""


def _diff(old: Any, new: Any, path: str, out: list[SnapshotChange]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        keyed = isinstance(old, _Keyed) or isinstance(new, _Keyed)
        for key in sorted(old.keys() | new.keys()):
            child = f"{path}[{key}]" if keyed else (f"{path}.{key}" if path else key)
            _diff(old.get(key, _ABSENT), new.get(key, _ABSENT), child, out)
    elif old != new:
        out.append(
            SnapshotChange(
                path=path,
                old=None if old is _ABSENT else _plain(old),
                new=None if new is _ABSENT else _plain(new),
            )
        )


def _plain(value: Any) -> Any:
    return dict(value) if isinstance(value, _Keyed) else value
