from __future__ import annotations

from typing import Any

import msgspec
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models

from controlplane.audit import Audited, short
from controlplane.policies.choices import (
    AlgorithmChoices,
    ExperimentKindChoices,
    ExperimentStatusChoices,
    TuningOutcomeChoices,
)
from routing import contract
from routing.contract import PARAMS_BY_ALGORITHM, WHOLE_PARAMS, PolicySnapshot, PolicySpec, params_errors

# What an operator reads in the history: the fields a policy edit can change.
POLICY_AUDIT_FIELDS = ("name", "description", "algorithm", "params", "model_scope", "residency", "max_rtt_ms")


class RoutingPolicy(Audited, models.Model):
    """How gateways choose a node: an algorithm, its parameters and its guards.

    At most one policy is active: the one whose compiled snapshot is live in Redis. Editing a
    policy changes nothing for the gateways until it is published.
    """

    name = models.CharField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    algorithm = models.CharField(
        max_length=32, choices=AlgorithmChoices.choices, default=AlgorithmChoices.GORGO
    )
    params = models.JSONField(
        default=dict,
        blank=True,
        help_text="Algorithm parameters; omitted ones take their documented defaults.",
    )
    model_scope = models.ManyToManyField(
        "fleet.LLMModel",
        related_name="routing_policies",
        blank=True,
        help_text="Models this policy serves; empty means every model of the fleet.",
    )
    residency = models.JSONField(
        default=list,
        blank=True,
        help_text='Data-residency rules: [{"client_region": "eu-central", "node_regions": ["eu-central"]}].',
    )
    max_rtt_ms = models.FloatField(
        null=True, blank=True, help_text="Never route to a node further than this round trip (ms)."
    )
    auto_tune = models.BooleanField(
        default=False,
        help_text="Let the online tuner move w_rtt and w_queue (gorgo only) while this policy is active.",
    )
    is_active = models.BooleanField(default=False, editable=False)
    created = models.DateTimeField(auto_now_add=True)
    last_updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "routing policies"
        permissions = [("publish_routingpolicy", "Can publish and roll back routing policies")]
        constraints = [
            models.UniqueConstraint(
                fields=["is_active"], condition=models.Q(is_active=True), name="one_active_policy"
            )
        ]

    def __str__(self) -> str:
        return self.name

    # ``is_active`` belongs to publishing alone, which sets it with one queryset update under the
    # publish lock (``publishing._publish_once``). An edit saves every other field: saving the whole
    # row wrote back the flag as it was when the edit was loaded, so a PATCH racing a publish left
    # no policy active (or two, refused by ``one_active_policy`` with a 500).
    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding and kwargs.get("update_fields") is None:
            kwargs["update_fields"] = [
                f.name for f in self._meta.concrete_fields if not f.primary_key and f.name != "is_active"
            ]
        super().save(*args, **kwargs)

    def validate_constraints(self, exclude: Any = None) -> None:
        # The in-memory flag may be stale (see save); the database enforces one_active_policy on
        # the publish's own update, so an edit is never refused for a flag it does not write.
        super().validate_constraints(exclude={*(exclude or ()), "is_active"})

    def clean(self) -> None:
        super().clean()
        errors: dict[str, Any] = {}
        if self.algorithm in PARAMS_BY_ALGORITHM:  # an unknown algorithm is the choices' error
            problems = params_errors(self.algorithm, self.params)
            if problems:
                # One error per parameter, which names it in ``params`` so the form can put it
                # next to that parameter's input; the API shows "name: problem".
                errors["params"] = [
                    ValidationError(
                        "%(param)s: %(problem)s" if name != WHOLE_PARAMS else "%(problem)s",
                        code="invalid_param",
                        params={"param": name, "problem": problem},
                    )
                    for name, problem in problems.items()
                ]
        if self.auto_tune and self.algorithm != "gorgo":
            errors["auto_tune"] = "Online tuning moves gorgo's weights; choose the gorgo algorithm."
        if self.max_rtt_ms is not None and not (0 < self.max_rtt_ms <= 10_000):
            errors["max_rtt_ms"] = "Maximum RTT must be between 0 and 10000 ms."
        residency_error = _residency_error(self.residency)
        if residency_error:
            errors["residency"] = residency_error
        if errors:
            raise ValidationError(errors)

    def audit_state(self) -> dict[str, Any]:
        """The audited fields, as plain values; ``params`` as the gateways would use them."""
        state = {name: getattr(self, name) for name in POLICY_AUDIT_FIELDS if name != "model_scope"}
        state["params"] = effective_params(self.algorithm, self.params)
        state["model_scope"] = sorted(self.model_scope.values_list("name", flat=True)) if self.pk else []
        return state

    @classmethod
    def describe_audit_changes(cls, before: dict[str, Any], after: dict[str, Any]) -> str:
        """``params.w_rtt: 1.0 -> 2.5; max_rtt_ms: None -> 300.0`` (empty when nothing changed)."""
        parts = []
        for name in POLICY_AUDIT_FIELDS:
            old, new = before.get(name), after.get(name)
            if isinstance(old, dict) or isinstance(new, dict):
                old, new = old or {}, new or {}
                for key in sorted(old.keys() | new.keys()):
                    if old.get(key) != new.get(key):
                        parts.append(f"{name}.{key}: {old.get(key)} -> {new.get(key)}")
            elif old != new:
                parts.append(f"{name}: {short(old)} -> {short(new)}")
        return "; ".join(parts)


def effective_params(algorithm: str, params: Any) -> Any:
    """The parameters the gateways would use: stored values plus the contract's defaults.

    So an edit that only spells out a default (or drops one) is not reported as a change.
    """
    struct = PARAMS_BY_ALGORITHM.get(algorithm)
    if struct is None or not isinstance(params, dict):
        return params
    try:
        values = msgspec.to_builtins(msgspec.convert(params, struct))
    except msgspec.ValidationError:
        return params
    values.pop("type", None)  # the union tag: the algorithm field says it already
    return values


def _residency_error(rules: object) -> str | None:
    """Return why the residency rules are invalid, or None."""
    from controlplane.fleet.models import Region

    if not isinstance(rules, list):
        return "Residency must be a list of rules."
    known = set(Region.objects.values_list("slug", flat=True))
    seen: set[str] = set()
    for index, rule in enumerate(rules):
        where = f"Rule {index + 1}"
        if not isinstance(rule, dict) or set(rule) != {"client_region", "node_regions"}:
            return f'{where}: each rule is {{"client_region": ..., "node_regions": [...]}}.'
        client, targets = rule["client_region"], rule["node_regions"]
        if client not in known:
            return f"{where}: unknown client region {client!r}."
        if client in seen:
            return f"{where}: client region {client!r} already has a rule."
        seen.add(client)
        if not isinstance(targets, list) or not targets:
            return f"{where}: node_regions must be a non-empty list of region slugs."
        unknown = [t for t in targets if t not in known]
        if unknown:
            return f"{where}: unknown node region(s) {', '.join(map(str, unknown))}."
    return None


class PolicyVersion(models.Model):
    """An immutable compiled snapshot of a policy with the fleet, as published to the gateways.

    Version numbers are global and only grow, so gateways can tell newer from older; a rollback
    publishes the old policy again as a new version.
    """

    policy = models.ForeignKey(RoutingPolicy, on_delete=models.PROTECT, related_name="versions")
    number = models.PositiveIntegerField(unique=True)
    checksum = models.CharField(max_length=64, db_index=True)
    snapshot = models.TextField(help_text="The compiled PolicySnapshot as published (JSON).")
    author = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="policy_versions",
    )
    author_name = models.CharField(max_length=150, help_text="Who published it (kept if the user goes).")
    note = models.CharField(max_length=500, blank=True)
    rolled_back_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="rollbacks"
    )
    created = models.DateTimeField(auto_now_add=True)
    published_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-number"]

    def __str__(self) -> str:
        return f"{self.policy.name} v{self.number}"

    def compiled(self) -> PolicySnapshot:
        """The stored snapshot as the typed struct the gateways read (the one decoder of it)."""
        return contract.decode(self.snapshot, PolicySnapshot)


class TuningWindow(models.Model):
    """One decision of the online tuner (GORGO v2) on a policy: the weights that were live, the p95
    TTFT their requests saw, what the tuner decided, and the version it published (if any). A
    canary trial spans as many windows as its verdict takes (``tuner_math.compare_arms``, at most
    ``MAX_WINDOWS_PER_TRIAL``); the row is written when it is decided.

    ``state`` is the tuner's state after the decision (``policies.tuner_math.TunerState``); the newest
    window of a policy is where the next one starts.
    """

    policy = models.ForeignKey(RoutingPolicy, on_delete=models.CASCADE, related_name="tuning_windows")
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()
    w_rtt = models.FloatField()
    w_queue = models.FloatField()
    p95_ms = models.FloatField()
    requests = models.PositiveIntegerField()
    outcome = models.CharField(max_length=16, choices=TuningOutcomeChoices.choices)
    sigma = models.FloatField(help_text="The step size after the decision (log units).")
    note = models.CharField(max_length=500)
    version = models.ForeignKey(
        PolicyVersion,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="tuning_windows",
        help_text="The version published after this window (none when the weights stayed).",
    )
    state = models.JSONField(default=dict)

    class Meta:
        ordering = ["-ended_at"]
        indexes = [models.Index(fields=["policy", "ended_at"], name="policies_tuning_policy_ts")]

    def __str__(self) -> str:
        return f"{self.policy_id} {self.ended_at:%H:%M:%S} {self.outcome}"


class PolicyExperiment(Audited, models.Model):
    """A policy run beside the live one (issue 23): in shadow (every gateway computes its decision
    and logs it, serving none) or as a canary (it serves a hash-chosen share of sessions).

    While ``running`` its trial is part of every snapshot published (``publishing.compile_spec``),
    so a fleet change or another publish carries it along; starting, stopping, promoting and the
    automatic rollback each publish a version (the version history) and write the audit log.
    ``figures`` are the workers' per-region sums over the request log (``telemetry.experiments``).
    At most one experiment of each kind runs at a time.
    """

    kind = models.CharField(max_length=16, choices=ExperimentKindChoices.choices)
    status = models.CharField(
        max_length=16, choices=ExperimentStatusChoices.choices, default=ExperimentStatusChoices.RUNNING
    )
    policy = models.ForeignKey(RoutingPolicy, on_delete=models.PROTECT, related_name="experiments")
    source_version = models.ForeignKey(
        PolicyVersion,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="experiments",
        help_text="The stored version under trial; empty: the policy's draft as compiled at the start.",
    )
    spec = models.TextField(help_text="The trial's compiled PolicySpec (JSON).")
    checksum = models.CharField(max_length=64, help_text="sha256 of the trial's PolicySpec.")
    share_percent = models.FloatField(
        null=True, blank=True, help_text="Canary: the share of sessions it serves, (0, 50]."
    )
    salt = models.CharField(max_length=32, blank=True)
    # The canary's automatic rollback (docs/controlplane.md, "Canary"): fires when, in some region,
    # the canary's TTFT is worse by more than margin_ms (or its error rate by more than
    # margin_error_rate) with the always-valid confidence 1 - alpha, and each arm has min_samples.
    margin_ms = models.FloatField(default=50.0)
    margin_error_rate = models.FloatField(default=0.02)
    min_samples = models.PositiveIntegerField(default=200)
    alpha = models.FloatField(default=0.05)
    started_at = models.DateTimeField(auto_now_add=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    started_by = models.CharField(max_length=150)
    ended_by = models.CharField(max_length=150, blank=True)
    end_note = models.CharField(max_length=500, blank=True)
    started_version = models.ForeignKey(
        PolicyVersion, null=True, blank=True, on_delete=models.SET_NULL, related_name="experiments_started"
    )
    ended_version = models.ForeignKey(
        PolicyVersion, null=True, blank=True, on_delete=models.SET_NULL, related_name="experiments_ended"
    )
    figures = models.JSONField(default=dict, blank=True)
    figures_updated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at", "-pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["kind"], condition=models.Q(status="running"), name="one_running_experiment_per_kind"
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} #{self.pk} of {self.policy.name}"

    def trial_policy(self) -> PolicySpec:
        """The trial's policy settings as the gateways get them."""
        return msgspec.json.decode(self.spec, type=PolicySpec)
