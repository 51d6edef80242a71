"""Shadow and canary on the gateway (issue 23): a trial policy digested for the request path.

The snapshot may carry a ``shadow`` and a ``canary`` (``contract.TrialSpec``, raw JSON decoded
apart). ``load_trial`` turns one into a ``TrialRoute``: its algorithm, parameters and its own
eligible candidates per model (its guards: residency, maximum RTT, model scope), precomputed with
the table, so the request path only looks them up. A trial this gateway cannot load (unreadable,
an algorithm it does not have, a failure while digesting it) is logged and left out: the gateway
keeps serving the live policy. ``in_canary`` is the session hash that picks the canary's share.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from routing.algorithms.base import AlgorithmInfo
from routing.contract import (
    AlgorithmParams,
    GorgoParams,
    NodeLiveState,
    NodeSpec,
    PolicySnapshot,
    TrialSpec,
    decode_trial,
)
from routing.state.eligibility import eligible_nodes, served_models

logger = logging.getLogger(__name__)

HASH_SPACE = 1 << 64  # a key's canary hash: 8 bytes of a keyed BLAKE2b


@dataclass(frozen=True, slots=True)
class TrialRoute:
    """A shadow or canary as the request path uses it."""

    spec: TrialSpec
    algorithm: AlgorithmInfo
    params: AlgorithmParams
    candidates: Mapping[str, tuple[NodeSpec, ...]]  # model -> eligible under the trial's guards
    threshold: int  # canary: a session whose hash is below this is in the canary
    salt_key: bytes  # the experiment's salt, the key of the session hash
    same_guards: bool  # its residency, maximum RTT and model scope are the live policy's
    reweighs: bool = False  # gorgo beside gorgo, same guards: the same per-node terms, weighed again
    # a canary that routes on what the gateway measured (gorgo's ``measured_inputs``; the live
    # policy's own setting is ``RoutingTable.measures_inputs``). A shadow decides on the live
    # request's view, its inputs included.
    measures_inputs: bool = False

    @property
    def id(self) -> int:
        return self.spec.id


def load_trial(
    raw: msgspec.Raw,
    snapshot: PolicySnapshot,
    region: str,
    registry: Mapping[str, AlgorithmInfo],
    live: Mapping[int, NodeLiveState],
    rtt_ms: Mapping[int, float],
) -> TrialRoute | None:
    """The snapshot's trial ready for the request path; None when there is none or it cannot load."""
    if not raw:
        return None
    try:
        spec = decode_trial(raw)
        assert spec is not None
        algorithm = registry.get(spec.policy.algorithm)
        if algorithm is None:
            raise ValueError(f"algorithm {spec.policy.algorithm!r} is not in this gateway")
        # Its own guards against the same fleet: the snapshot with the trial's policy in it.
        as_live = msgspec.structs.replace(snapshot, policy=spec.policy)
        candidates = {
            model: eligible_nodes(as_live, model, region, live, rtt_ms)[0] for model in served_models(as_live)
        }
    except Exception as exc:  # whatever it is, the live policy must keep serving
        _warn_once(f"snapshot v{snapshot.version}: ignoring its trial (serving the live policy only): {exc}")
        return None
    same_guards = (spec.policy.residency, spec.policy.max_rtt_ms, spec.policy.model_scope) == (
        snapshot.policy.residency,
        snapshot.policy.max_rtt_ms,
        snapshot.policy.model_scope,
    )
    live_params = snapshot.policy.params
    return TrialRoute(
        spec=spec,
        algorithm=algorithm,
        params=spec.policy.params,
        candidates=candidates,
        threshold=int(min(max(spec.share, 0.0), 0.5) * HASH_SPACE),
        salt_key=spec.salt.encode()[:64],  # BLAKE2b takes keys of up to 64 bytes
        same_guards=same_guards,
        reweighs=same_guards
        and isinstance(spec.policy.params, GorgoParams)
        and isinstance(live_params, GorgoParams),
        measures_inputs=isinstance(spec.policy.params, GorgoParams) and spec.policy.params.measured_inputs,
    )


def in_canary(canary: TrialRoute, key: str) -> bool:
    """Whether the sessions of ``key`` (session, else client key, else request id) are in the canary.

    BLAKE2b keyed with the experiment's salt: stable across gateways and restarts (unlike
    ``hash()``), so a conversation stays on one side wherever it lands, and each canary picks its
    own sessions, independently of every other canary's. (crc32 continued from the salt, as
    before, is linear: for keys of one length, such as UUIDs, two canaries' hashes differed by one
    constant, so their sessions were either disjoint or nearly the same.) About 1 us, only while
    a canary runs.
    """
    digest = hashlib.blake2b(key.encode(), digest_size=8, key=canary.salt_key).digest()
    return int.from_bytes(digest, "big") < canary.threshold


@functools.lru_cache(maxsize=16)
def _warn_once(message: str) -> None:
    # The table is rebuilt on every live-state change; say it once per snapshot, not every second.
    logger.warning("%s", message)
