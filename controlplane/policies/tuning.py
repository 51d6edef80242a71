"""The online tuner over the live system: each trial runs as a canary beside the live weights.

``tune_policy(policy, now_s)`` is one tick (the ``policies.tune`` task calls it periodically):

- with no trial running, it proposes one (``tuner_math.mutate`` of the incumbent, or the trial the
  last decision chose) and starts it as a canary on ``GORGO_TUNER_CANARY_PERCENT`` of the sessions
  (``experiments.start``, authored by ``TUNER_AUTHOR``): the rest of the fleet keeps the
  incumbent, so a bad trial costs only its share, and the canary's automatic rollback guards it;
- once the canary has run ``GORGO_TUNER_WINDOW_S`` (plus ``SETTLE_S`` for the gateways to swap)
  and each arm holds ``GORGO_TUNER_MIN_REQUESTS`` answered requests, the two arms' TTFTs since the
  canary started, from the same traffic (the canary's running sums of log TTFT, kept behind a
  cursor into the request log by ``experiment_figures``: no tick re-reads what an earlier one
  counted), go to ``tuner_math.compare_arm_sums`` at every tick: a trial
  faster with confidence is written into the policy's params and promoted (published as the live
  policy, a version whose note carries the evidence); one shown not faster enough, or still
  undecided after ``tuner_math.MAX_WINDOWS_PER_TRIAL`` windows, is stopped; while undecided the
  canary keeps running and its samples accumulate (``tuner_math.judge``: the (1+1)-ES's update);
- a trial the automatic rollback ended counts as rejected;
- every decision is kept (``TuningWindow``, with the trial's weights and p95): the dashboard's
  policy page draws them, and the newest holds the search's state.

It stands aside when someone else moved the policy: if the live weights are not the incumbent it
knows (an operator published), the search restarts from the live weights; if the policy has
unpublished edits it starts no trial and promotes none (it would publish them too); while an
operator's canary runs it starts none (one canary at a time).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from datetime import UTC, datetime

import msgspec
from django.conf import settings
from django.db import transaction

from controlplane import audit
from controlplane.api import ConflictError
from controlplane.connections import redis_client, redis_keys
from controlplane.histogram import histogram_quantile_ms
from controlplane.policies import experiment_figures, experiments, publishing, tuner_math
from controlplane.policies.choices import ExperimentKindChoices, ExperimentStatusChoices
from controlplane.policies.models import PolicyExperiment, PolicyVersion, RoutingPolicy, TuningWindow
from controlplane.policies.tuner_math import Bounds, TunerState, Weights
from routing.contract import GorgoParams, PolicySnapshot

log = logging.getLogger(__name__)

TUNER_AUTHOR = "online tuner"
SETTLE_S = 2.0  # gateways swap to a new snapshot within a second of its announcement
BOUNDS = Bounds()


def live_weights(snapshot: PolicySnapshot) -> Weights | None:
    params = snapshot.policy.params
    return (params.w_rtt, params.w_queue) if isinstance(params, GorgoParams) else None


def arm_figures(canary: PolicyExperiment) -> dict[str, tuple[tuner_math.LogSums, dict[str, int]]]:
    """Each arm's TTFT since ``canary`` started (log sums, merged histogram), every region pooled.

    The canary's figures are running sums behind a cursor into the request log
    (``experiment_figures.collect``, which ``policies.watch_experiments`` runs too; its
    compare-and-swap counts every record once). Collecting here first brings them up to this tick;
    a tick that lags further than ``MAX_RECORDS_PER_TICK`` records decides on what is counted so
    far and the next tick goes on from the cursor, so the sample grows at any traffic.
    """
    experiment_figures.collect(redis_client(), redis_keys(), canary)
    canary.refresh_from_db(fields=["figures"])
    return {arm: experiment_figures.arm_totals(canary.figures, arm) for arm in ("live", "canary")}


def tune_policy(policy: RoutingPolicy, now_s: float, rng: random.Random | None = None) -> TuningWindow | None:
    """One tick of the tuner on the active ``policy``; the window it closed, or None (none closed)."""
    live = publishing.live_version()
    if live is None or live.policy_id != policy.pk or live.published_at is None:
        return None
    weights = live_weights(live.compiled())
    if weights is None:
        return None
    last = policy.tuning_windows.first()
    state = TunerState.from_json(last.state) if last is not None and last.state else None
    if state is None or not _same(state.incumbent, weights):
        state = TunerState(incumbent=weights)  # first tick, or an operator published: start here
    rng = rng or random.Random(f"{policy.pk}:{policy.tuning_windows.count()}")
    canary = _tuner_canary(policy, since=last.ended_at if last is not None else None)
    if canary is None:
        _start_trial(policy, live, state, rng)
        return None
    trial = _canary_weights(canary)
    state = dataclasses.replace(state, trial=trial)
    if canary.status == ExperimentStatusChoices.ROLLED_BACK:
        # The automatic rollback found it worse: a rejection, measured by the canary's own test.
        result = tuner_math.decide(state, False, "", rng, BOUNDS, incumbent_p95_ms=state.incumbent_p95_ms)
        result = dataclasses.replace(result, note=f"tuner: {_fmt(trial)} {canary.end_note}")
        return _record(policy, canary, trial, math.inf, 0, result, None, now_s)
    started_s = canary.started_at.timestamp() + SETTLE_S
    windows = int((now_s - started_s) // settings.GORGO_TUNER_WINDOW_S)
    if windows < 1:
        return None
    arms = arm_figures(canary)
    (live_sums, live_histogram), (trial_sums, trial_histogram) = arms["live"], arms["canary"]
    if min(live_sums.count, trial_sums.count) < settings.GORGO_TUNER_MIN_REQUESTS:
        return None  # a quiet fleet gives no evidence either way: wait for it
    test = tuner_math.compare_arm_sums(live_sums, trial_sums, windows)
    if test.verdict == "undecided":
        return None  # the always-valid interval allows looking again at the next tick
    incumbent_p95 = histogram_quantile_ms(live_histogram, 0.95) or math.inf
    trial_p95 = histogram_quantile_ms(trial_histogram, 0.95) or math.inf
    result = tuner_math.judge(state, test, rng, BOUNDS, live_p95_ms=incumbent_p95, trial_p95_ms=trial_p95)
    version = None
    if result.outcome == "accepted":
        version = _promote(policy, canary, live, trial, result.note)
        if version is None:
            return None
    else:
        experiments.stop(canary, user=audit.system_user(), note=result.note, author_name=TUNER_AUTHOR)
    return _record(policy, canary, trial, trial_p95, trial_sums.count, result, version, now_s)


def _promote(
    policy: RoutingPolicy, canary: PolicyExperiment, live: PolicyVersion, trial: Weights, note: str
) -> PolicyVersion | None:
    """Write the trial's weights into the policy and promote the canary, in one transaction.

    The version promoted, or None when the canary ended meanwhile or the policy has edits nobody
    published (promoting would publish them too). The policy is re-read under its row lock: this
    tick's copy may predate an operator's edit, which saving it would overwrite; and a promote that
    fails (Redis down) takes the weights back with it. The locks are taken in the order of every
    other step (the experiment's row, the publish lock, the policy's row), so none can deadlock.
    """
    try:
        with transaction.atomic():
            canary = experiments.lock_running(canary)
            publishing.lock_publishes()
            locked = RoutingPolicy.objects.select_for_update().get(pk=policy.pk)
            if publishing.compile_policy(locked).checksum != live.checksum:
                log.info("tuner: %s has unpublished edits; not promoting over them", policy.name)
                return None
            locked.params = {**locked.params, "w_rtt": trial[0], "w_queue": trial[1]}
            locked.save(update_fields=["params", "last_updated"])
            return experiments.promote(
                canary, user=audit.system_user(), note=note, author_name=TUNER_AUTHOR
            ).ended_version
    except ConflictError:
        log.info("tuner: canary #%d ended meanwhile; not promoting it", canary.pk)
        return None


def _tuner_canary(policy: RoutingPolicy, since) -> PolicyExperiment | None:
    """The tuner's running canary, or one the automatic rollback ended since the last window."""
    mine = PolicyExperiment.objects.filter(
        kind=ExperimentKindChoices.CANARY, policy=policy, started_by=TUNER_AUTHOR
    ).select_related("policy", "source_version")
    running = mine.filter(status=ExperimentStatusChoices.RUNNING).first()
    if running is not None:
        return running
    rolled_back = mine.filter(status=ExperimentStatusChoices.ROLLED_BACK)
    if since is not None:
        rolled_back = rolled_back.filter(ended_at__gt=since)
    return rolled_back.first()


def _start_trial(policy: RoutingPolicy, live, state: TunerState, rng: random.Random) -> None:
    if state.converged:
        return
    if PolicyExperiment.objects.filter(
        kind=ExperimentKindChoices.CANARY, status=ExperimentStatusChoices.RUNNING
    ).exists():
        return  # an operator's canary: one at a time
    if publishing.compile_policy(policy).checksum != live.checksum:
        log.info("tuner: %s has unpublished edits; no trial until they are published", policy.name)
        return
    trial = (
        state.trial
        if state.trial is not None
        else tuner_math.mutate(state.incumbent, state.sigma, rng, BOUNDS)
    )
    trial = (round(trial[0], 4), round(trial[1], 4))  # the policy keeps weights to 4 decimals
    spec = live.compiled().policy
    spec = msgspec.structs.replace(
        spec, params=msgspec.structs.replace(spec.params, w_rtt=trial[0], w_queue=trial[1])
    )
    experiments.start(
        ExperimentKindChoices.CANARY,
        policy=policy,
        spec=spec,
        source_version=None,
        user=audit.system_user(),
        author_name=TUNER_AUTHOR,
        share_percent=settings.GORGO_TUNER_CANARY_PERCENT,
        note=f"tuner: trying w_rtt={trial[0]:.3g}, w_queue={trial[1]:.3g} beside {_fmt(state.incumbent)} "
        f"(step {state.sigma:.2f})",
    )


def _canary_weights(canary: PolicyExperiment) -> Weights:
    params = canary.trial_policy().params
    assert isinstance(params, GorgoParams)
    return (params.w_rtt, params.w_queue)


def _record(policy, canary, trial, p95_ms, requests, result, version, now_s) -> TuningWindow:
    return TuningWindow.objects.create(
        policy=policy,
        started_at=canary.started_at,
        ended_at=datetime.fromtimestamp(now_s, UTC),
        w_rtt=trial[0],
        w_queue=trial[1],
        p95_ms=p95_ms if math.isfinite(p95_ms) else 0.0,
        requests=requests,
        outcome=result.outcome,
        sigma=result.state.sigma,
        note=result.note[:500],
        version=version,
        state=result.state.to_json(),
    )


def _fmt(weights: Weights) -> str:
    return f"w_rtt={weights[0]:.3g}, w_queue={weights[1]:.3g}"


def _same(a: Weights, b: Weights) -> bool:
    # The policy keeps weights to 4 decimals; the tuner's state keeps them exact.
    return abs(a[0] - b[0]) < 1e-3 and abs(a[1] - b[1]) < 1e-3
