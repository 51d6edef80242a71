"""Shadow and canary (issue 23): start, stop, promote, and the canary's automatic rollback.

Each step is one database transaction that changes the ``PolicyExperiment``, publishes a version
(``publishing``: running experiments are compiled into every snapshot, so the publish is what puts
the trial on the gateways or takes it off), and writes the audit log. The Redis write is the last
thing inside the transaction, so a step that cannot reach the gateways leaves nothing behind
(``PublishError``: 503, nothing changed).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass

import msgspec
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane import audit
from controlplane.api import ConflictError
from controlplane.fleet.models import LLMModel
from controlplane.policies import canary_stats, publishing
from controlplane.policies.choices import ExperimentKindChoices, ExperimentStatusChoices
from controlplane.policies.models import PolicyExperiment, PolicyVersion, RoutingPolicy
from routing.contract import ALGORITHMS, MAX_CANARY_SHARE, PolicySpec

log = logging.getLogger(__name__)

RUNNING = ExperimentStatusChoices.RUNNING


@dataclass(frozen=True, slots=True)
class CanaryLimits:
    """When the automatic rollback fires (``PolicyExperiment`` fields of the same names)."""

    margin_ms: float = 50.0
    margin_error_rate: float = 0.02
    min_samples: int = 200
    alpha: float = 0.05


def trial_from_version(version: PolicyVersion) -> PolicySpec:
    """The policy settings of a stored version, if this control plane and the fleet can still run them.

    Raises ``ValidationError`` (400) saying what to do otherwise.
    """
    try:
        spec = version.compiled().policy
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ValidationError(
            {
                "version": f"Version {version.number} cannot be read by this control plane ({exc}); "
                "edit its policy and start a draft instead."
            }
        ) from None
    if spec.algorithm not in ALGORITHMS:  # the contract's list is the gateways' (policies.E001)
        raise ValidationError(
            {
                "version": f"Version {version.number} uses algorithm {spec.algorithm!r}, which the gateways "
                "no longer have; start a draft with a current algorithm."
            }
        )
    missing = set(spec.model_scope) - set(
        LLMModel.objects.filter(name__in=spec.model_scope).values_list("name", flat=True)
    )
    if missing:
        raise ValidationError(
            {
                "version": f"Version {version.number} serves models that no longer exist "
                f"({', '.join(sorted(missing))}); start a draft of its policy without them."
            }
        )
    return spec


def trial_from_draft(policy: RoutingPolicy) -> PolicySpec:
    """The policy as it is in the database now, validated and compiled (``ValidationError``: 400)."""
    return publishing.compile_policy(policy).policy


def start(
    kind: str,
    *,
    policy: RoutingPolicy,
    spec: PolicySpec,
    source_version: PolicyVersion | None,
    user: AbstractBaseUser,
    share_percent: float | None = None,
    limits: CanaryLimits = CanaryLimits(),
    note: str = "",
    author_name: str | None = None,
) -> PolicyExperiment:
    """Start a shadow or canary of ``spec`` and publish it to the gateways.

    ``ConflictError`` (409) when nothing is live yet or one of this kind is running already.
    """
    if kind == ExperimentKindChoices.CANARY and not (
        share_percent is not None and 0 < share_percent <= MAX_CANARY_SHARE * 100
    ):
        raise ValidationError({"share_percent": "A canary's share must be more than 0 and at most 50 (%)."})
    who = author_name or user.get_username()
    try:
        with transaction.atomic():
            if publishing.live_version() is None:
                raise ConflictError(
                    "Nothing is live yet: a shadow or canary runs beside the live policy. Publish a policy first."
                )
            running = PolicyExperiment.objects.select_for_update().filter(kind=kind, status=RUNNING).first()
            if running is not None:
                raise ConflictError(_already_running(running))
            experiment = PolicyExperiment.objects.create(
                kind=kind,
                policy=policy,
                source_version=source_version,
                spec=msgspec.json.encode(spec).decode(),
                checksum=hashlib.sha256(msgspec.json.encode(spec)).hexdigest(),
                share_percent=share_percent if kind == ExperimentKindChoices.CANARY else None,
                salt=secrets.token_hex(8),
                margin_ms=limits.margin_ms,
                margin_error_rate=limits.margin_error_rate,
                min_samples=limits.min_samples,
                alpha=limits.alpha,
                started_by=who,
            )
            what = _describe(experiment)
            result = publishing.republish_live(f"{what} started" + (f": {note}" if note else ""))
            assert result is not None  # something is live (checked above, in this transaction)
            experiment.started_version = result.version
            experiment.save(update_fields=["started_version"])
            audit.record(user, experiment, f"Started {what} (version {result.version.number}).", added=True)
    except IntegrityError:
        # The one-running-per-kind constraint: another start won the race.
        running = PolicyExperiment.objects.filter(kind=kind, status=RUNNING).first()
        raise ConflictError(
            _already_running(running) if running else "Another start won; try again."
        ) from None
    log.info("%s started by %s", what, who)
    return experiment


def stop(
    experiment: PolicyExperiment, *, user: AbstractBaseUser, note: str = "", author_name: str | None = None
) -> PolicyExperiment:
    """Take a running experiment off the gateways (a new version without it).

    ``author_name`` names who acted when it is not ``user`` (the online tuner, recorded as gorgo-system).
    """
    return _end(
        experiment,
        ExperimentStatusChoices.STOPPED,
        user=user,
        note=note or "stopped",
        author_name=author_name,
    )


def promote(
    experiment: PolicyExperiment, *, user: AbstractBaseUser, note: str = "", author_name: str | None = None
) -> PolicyExperiment:
    """Publish the trial as the live policy and end the experiment (both in one version).

    The policy's database row is left alone: a promoted stored version is published from its spec,
    like a republish, so unpublished edits of the row are neither lost nor published.
    """
    with transaction.atomic():
        experiment = lock_running(experiment)
        who = author_name or user.get_username()
        _finish(experiment, ExperimentStatusChoices.PROMOTED, who, note or "promoted")
        experiment.save()  # no longer running: the version below is compiled without it
        result = publishing.publish(
            experiment.policy,
            author=None if author_name else user,
            system_author=who,
            spec=experiment.trial_policy(),
            note=f"{_describe(experiment)} promoted" + (f": {note}" if note else ""),
        )
        experiment.ended_version = result.version
        experiment.save()
        audit.record(user, experiment, f"Promoted {_describe(experiment)} (version {result.version.number}).")
    return experiment


def rollback_canary(experiment: PolicyExperiment, reason: str) -> PolicyExperiment:
    """The automatic rollback: the canary is worse; take it off the gateways (recorded as gorgo-system)."""
    return _end(
        experiment,
        ExperimentStatusChoices.ROLLED_BACK,
        user=audit.system_user(),
        note=f"automatic rollback: {reason}",
    )


def verdicts(experiment: PolicyExperiment) -> list[canary_stats.Verdict]:
    """The canary against the rest, per region, from the workers' figures."""
    regions = {
        region: (
            canary_stats.ArmSums.from_json(arms.get("canary")),
            canary_stats.ArmSums.from_json(arms.get("live")),
        )
        for region, arms in (experiment.figures or {}).get("regions", {}).items()
        if isinstance(arms, dict)
    }
    return canary_stats.compare_regions(
        regions,
        margin_ms=experiment.margin_ms,
        margin_error_rate=experiment.margin_error_rate,
        min_samples=experiment.min_samples,
        alpha=experiment.alpha,
    )


def check_canary(experiment: PolicyExperiment) -> PolicyExperiment | None:
    """Roll the canary back when some region shows it worse by more than its margin; else None."""
    if experiment.kind != ExperimentKindChoices.CANARY or experiment.status != RUNNING:
        return None
    worse = [f"{v.region}: {v.worse}" for v in verdicts(experiment) if v.worse]
    if not worse:
        return None
    try:
        return rollback_canary(experiment, "; ".join(worse))
    except ConflictError:
        return None  # someone stopped or promoted it meanwhile


# ---- helpers ---------------------------------------------------------------------------------


def _end(
    experiment: PolicyExperiment,
    status: str,
    *,
    user: AbstractBaseUser,
    note: str,
    author_name: str | None = None,
) -> PolicyExperiment:
    with transaction.atomic():
        experiment = lock_running(experiment)
        _finish(experiment, status, author_name or user.get_username(), note)
        experiment.save()
        # Compiled without it now (it is no longer running): the gateways drop it.
        result = publishing.republish_live(f"{_describe(experiment)} {status.replace('_', ' ')}: {note}")
        if result is not None:
            experiment.ended_version = result.version
            experiment.save(update_fields=["ended_version"])
        version = f" (version {result.version.number})" if result is not None else ""
        audit.record(
            user,
            experiment,
            f"{status.replace('_', ' ').capitalize()} {_describe(experiment)}{version}: {note}",
        )
    log.info("%s %s: %s", _describe(experiment), status, note)
    return experiment


def lock_running(experiment: PolicyExperiment) -> PolicyExperiment:
    """The experiment re-read under its row lock; ``ConflictError`` when it is no longer running.

    Every step that ends one takes this lock before the publish lock (``publishing.lock_publishes``).
    """
    # Lock the experiment's row only: PostgreSQL refuses FOR UPDATE on the nullable side of the
    # outer join that select_related makes for ``source_version`` (a draft has none).
    locked = (
        PolicyExperiment.objects.select_for_update(of=("self",))
        .select_related("policy", "source_version")
        .get(pk=experiment.pk)
    )
    if locked.status != RUNNING:
        raise ConflictError(
            f"{_describe(locked).capitalize()} is not running (it is {locked.get_status_display().lower()})."
        )
    return locked


def _finish(experiment: PolicyExperiment, status: str, who: str, note: str) -> None:
    experiment.status = status
    experiment.ended_at = timezone.now()
    experiment.ended_by = who
    experiment.end_note = note[:500]


def _describe(experiment: PolicyExperiment) -> str:
    source = f"v{experiment.source_version.number}" if experiment.source_version is not None else "draft"
    share = f" at {experiment.share_percent:g} %" if experiment.share_percent else ""
    return f"{experiment.kind} #{experiment.pk} ({experiment.policy.name} {source}{share})"


def _already_running(running: PolicyExperiment) -> str:
    return (
        f"A {running.kind} is already running ({_describe(running)}); stop or promote it first: "
        f"POST /api/v1/policy-experiments/{running.pk}/stop/."
    )
