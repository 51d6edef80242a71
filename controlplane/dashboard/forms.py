"""Forms of the policy editor, node actions and publishing.

Validation lives in one place, ``RoutingPolicy.clean()`` (and through it the contract's msgspec
parameter structs). These forms only convert what the browser sent into the model's shape and put
the model's errors back next to the field the operator typed into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from django import forms
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from controlplane.fleet.models import Region
from controlplane.keys.models import ClientKey
from controlplane.policies.models import PolicyVersion, RoutingPolicy
from routing.contract import PARAMS_BY_ALGORITHM

# What each parameter does, for the operator deciding on a value. Limits come from the contract.
PARAM_HELP: dict[str, dict[str, str]] = {
    "gorgo": {
        "w_rtt": "Weight of the network round trip (gateway region to node) in the cost. "
        "1 counts each millisecond of RTT as a millisecond of TTFT.",
        "w_queue": "Weight of the node's estimated queueing delay. Raise it to spread load away from busy nodes.",
        "default_rtt_ms": "RTT assumed for a region-to-node pair that has not been measured yet (ms).",
        "chars_per_token": "Prompt characters per token, to estimate prompt tokens before the node tokenises.",
        "w_displacement": "Weight of the wait a request sent abroad causes the receiving region's own "
        "clients (coordinated overflow); 0 lets every request think only of itself.",
        "homing_rent_ratio": "A prompt family cached only abroad comes home once its region's requests "
        "have paid this many times the price of caching it at home in round trips; 0: never.",
        "measured_inputs": "Route on what each gateway measures of a node from its own answers (its round "
        "trip, its prefill speed) instead of the probed RTT and configured speed, once measured.",
    },
    "prefix_affinity": {
        "cache_threshold": "Follow the longest cached prefix only when it covers at least this share of "
        "the prompt (0 to 1); below it, pick the least-loaded node.",
        "balance_abs_threshold": "The fleet counts as imbalanced when the busiest node has this many more "
        "outstanding requests than the idlest ...",
        "balance_rel_threshold": "... and at least this many times as many. Then route by load, ignoring the cache.",
        "scope": "global: every eligible node; local: the gateway's own region only, abroad only when "
        "none of its nodes is eligible (a cache-aware router per region behind geo-DNS).",
    },
    "session_affinity": {
        "session_header": "Request header carrying the session key (else the OpenAI `user` field).",
        "virtual_nodes": "Points per node on the hash ring: more spread sessions more evenly.",
    },
}
PARAM_UNITS: dict[str, str] = {"default_rtt_ms": "ms", "balance_abs_threshold": "requests"}
PARAM_LABELS: dict[str, str] = {
    "w_rtt": "RTT weight",
    "w_queue": "Queue weight",
    "default_rtt_ms": "Default RTT (ms)",
    "chars_per_token": "Characters per token",
    "w_displacement": "Displacement weight",
    "homing_rent_ratio": "Homing rent ratio",
    "measured_inputs": "Measured inputs",
    "scope": "Scope",
    "cache_threshold": "Cache-match threshold",
    "balance_abs_threshold": "Imbalance, absolute",
    "balance_rel_threshold": "Imbalance, relative",
    "session_header": "Session header",
    "virtual_nodes": "Virtual nodes per node",
}


@dataclass(frozen=True, slots=True)
class ParamField:
    """One algorithm parameter as a form field: which algorithm, its name, and its form name."""

    algorithm: str
    name: str
    form_name: str


def _param_form_name(algorithm: str, name: str) -> str:
    return f"param_{algorithm}_{name}"


def _limits(type_info: Any) -> str:
    low = getattr(type_info, "ge", None)
    high = getattr(type_info, "le", None)
    if low is not None and high is not None:
        return f"{low:g} to {high:g}"
    if low is not None:
        return f"at least {low:g}"
    if high is not None:
        return f"at most {high:g}"
    return ""


def _build_param_field(algorithm: str, info: msgspec.inspect.Field) -> forms.Field:
    """A plain typed form field: it converts text to a number, the contract decides what is allowed."""
    help_parts = [PARAM_HELP.get(algorithm, {}).get(info.name, "")]
    limits = _limits(info.type)
    if limits:
        help_parts.append(
            f"Allowed: {limits}{' ' + PARAM_UNITS[info.name] if info.name in PARAM_UNITS else ''}."
        )
    help_parts.append(f"Default {info.default}.")
    options = {
        "required": False,
        "label": f"{PARAM_LABELS.get(info.name, info.name)} ({info.name})",
        "help_text": " ".join(part for part in help_parts if part),
        "initial": info.default,
    }
    if isinstance(info.type, msgspec.inspect.FloatType):
        field: forms.Field = forms.FloatField(widget=forms.NumberInput(attrs={"step": "any"}), **options)
    elif isinstance(info.type, msgspec.inspect.IntType):
        field = forms.IntegerField(**options)
    elif isinstance(info.type, msgspec.inspect.BoolType):
        # A choice, not a check box: an unticked box cannot tell "no" from "the default".
        field = forms.TypedChoiceField(
            choices=[("", "(default)"), ("true", "yes"), ("false", "no")],
            coerce=lambda value: value == "true",
            empty_value=None,
            **{**options, "initial": "true" if info.default else "false"},
        )
    else:
        field = forms.CharField(**options)
    field.initial_default = info.default
    return field


def param_fields() -> list[tuple[ParamField, forms.Field]]:
    """Every parameter of every algorithm, from the contract's structs."""
    fields = []
    for algorithm, struct in PARAMS_BY_ALGORITHM.items():
        for info in msgspec.inspect.type_info(struct).fields:
            ref = ParamField(algorithm, info.name, _param_form_name(algorithm, info.name))
            fields.append((ref, _build_param_field(algorithm, info)))
    return fields


class ResidencyWidget(forms.Widget):
    """A grid of check boxes: one row per client region, one column per node region it may use."""

    def __init__(self, regions: list[str], attrs: dict | None = None) -> None:
        super().__init__(attrs)
        self.regions = regions

    def value_from_datadict(self, data, files, name):
        rules = []
        for client in self.regions:
            targets = [slug for slug in data.getlist(f"{name}_{client}") if slug]
            if targets:
                rules.append({"client_region": client, "node_regions": targets})
        return rules

    def value_omitted_from_data(self, data, files, name) -> bool:
        return False  # no box ticked is a real answer: no rules

    def render(self, name, value, attrs=None, renderer=None) -> str:
        allowed = {
            rule.get("client_region"): set(rule.get("node_regions") or [])
            for rule in (value or [])
            if isinstance(rule, dict)
        }
        head = format_html_join(
            "",
            '<th scope="col"><span class="region-dot" data-region="{}"></span>{}</th>',
            ((slug, slug) for slug in self.regions),
        )
        rows = []
        for client in self.regions:
            cells = format_html_join(
                "",
                '<td><input type="checkbox" name="{}" value="{}" aria-label="{} may use {}"{}></td>',
                (
                    (
                        f"{name}_{client}",
                        target,
                        client,
                        target,
                        mark_safe(" checked") if target in allowed.get(client, ()) else "",
                    )
                    for target in self.regions
                ),
            )
            scope = "only ticked regions" if client in allowed else "any region"
            rows.append(
                format_html(
                    '<tr><th scope="row"><span class="region-dot" data-region="{}"></span>{}</th>{}'
                    '<td class="muted">{}</td></tr>',
                    client,
                    client,
                    cells,
                    scope,
                )
            )
        return format_html(
            '<table class="residency-grid" id="{}"><thead><tr><th>clients in \u2193 may use \u2192</th>{}'
            "<th></th></tr></thead><tbody>{}</tbody></table>",
            (attrs or {}).get("id", f"id_{name}"),
            head,
            mark_safe("".join(rows)),
        )


class ResidencyField(forms.Field):
    """Data-residency rules as the model stores them: ``[{"client_region", "node_regions"}]``."""

    def __init__(self, *, regions: list[str], **kwargs) -> None:
        kwargs.setdefault("required", False)
        super().__init__(widget=ResidencyWidget(regions), **kwargs)

    def has_changed(self, initial, data) -> bool:
        def canonical(rules):
            return sorted((r["client_region"], sorted(r["node_regions"])) for r in rules or [])

        return canonical(initial) != canonical(data)


class PolicyForm(forms.ModelForm):
    """Create or edit a routing policy. Publishing is a separate, explicit step."""

    class Meta:
        model = RoutingPolicy
        fields = ["name", "description", "algorithm", "model_scope", "residency", "max_rtt_ms", "auto_tune"]
        widgets = {
            "description": forms.Textarea(attrs={"rows": 2}),
            "model_scope": forms.CheckboxSelectMultiple,
            "max_rtt_ms": forms.NumberInput(attrs={"step": "any", "placeholder": "no limit"}),
        }
        labels = {
            "max_rtt_ms": "Maximum RTT (ms)",
            "model_scope": "Model scope",
            "auto_tune": "Online tuning",
        }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        regions = list(Region.objects.order_by("slug").values_list("slug", flat=True))
        self.fields["residency"] = ResidencyField(
            regions=regions,
            label="Data residency",
            help_text="Tick the node regions each client region may be served from. "
            "A client region with nothing ticked may use every region.",
        )
        self.fields[
            "max_rtt_ms"
        ].help_text = (
            "Never route to a node further than this round trip from the gateway's region. Empty: no limit."
        )
        self.param_refs: list[ParamField] = []
        current = self.instance.params if isinstance(self.instance.params, dict) else {}
        for ref, field in param_fields():
            if ref.algorithm == self.instance.algorithm and ref.name in current:
                value = current[ref.name]
                field.initial = ("true" if value else "false") if isinstance(value, bool) else value
            self.fields[ref.form_name] = field
            self.param_refs.append(ref)

    def param_groups(self) -> list[dict[str, Any]]:
        """Parameter fields grouped by algorithm, for the template (one fieldset each)."""
        groups = []
        for value, label in self.fields["algorithm"].choices:
            bound = [self[ref.form_name] for ref in self.param_refs if ref.algorithm == value]
            groups.append({"algorithm": value, "label": label, "fields": bound})
        return groups

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        algorithm = cleaned.get("algorithm")
        params: dict[str, Any] = {}
        for ref in self.param_refs:
            value = cleaned.get(ref.form_name)
            # Defaults are left out: the contract supplies them ("omitted ones take their defaults").
            if (
                ref.algorithm == algorithm
                and value not in (None, "")
                and value != self.fields[ref.form_name].initial_default
            ):
                params[ref.name] = value
        self.instance.params = params
        return cleaned

    def _update_errors(self, errors: ValidationError) -> None:
        # RoutingPolicy.clean() reports parameter problems on "params", one error per parameter
        # (its name in the error's params); show each next to the parameter's own input instead.
        if hasattr(errors, "error_dict") and "params" in errors.error_dict:
            algorithm = self.cleaned_data.get("algorithm", self.instance.algorithm)
            for error in errors.error_dict.pop("params"):
                details = error.params or {}
                name, problem = details.get("param"), details.get("problem", error.message)
                form_name = _param_form_name(algorithm, name) if name else None
                self.add_error(form_name if form_name in self.fields else NON_FIELD_ERRORS, problem)
            if not errors.error_dict:
                return
        super()._update_errors(errors)


class PublishForm(forms.Form):
    """Publish the reviewed snapshot: the checksum pins what the operator looked at."""

    note = forms.CharField(
        max_length=500, required=False, widget=forms.TextInput(attrs={"placeholder": "why"})
    )
    checksum = forms.CharField(max_length=64, widget=forms.HiddenInput)


class RollbackForm(forms.Form):
    """Publish the settings of an earlier version of this policy again."""

    version = forms.ModelChoiceField(queryset=PolicyVersion.objects.none(), to_field_name="number")
    note = forms.CharField(max_length=500, required=False)

    def __init__(self, *args, policy: RoutingPolicy, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["version"].queryset = policy.versions.all()
        self.fields["version"].error_messages["invalid_choice"] = (
            "That version does not belong to this policy."
        )


class ClientKeyForm(forms.ModelForm):
    """Create a client key; the secret is made by the model, never typed."""

    class Meta:
        model = ClientKey
        fields = [
            "name",
            "owner",
            "team",
            "priority",
            "allowed_models",
            "allowed_regions",
            "requests_per_min",
            "tokens_per_min",
            "max_concurrent",
            "expires_at",
        ]
        widgets = {
            "allowed_models": forms.CheckboxSelectMultiple,
            "allowed_regions": forms.CheckboxSelectMultiple,
            "expires_at": forms.DateTimeInput(attrs={"type": "datetime-local"}),
            "requests_per_min": forms.NumberInput(attrs={"placeholder": "unlimited"}),
            "tokens_per_min": forms.NumberInput(attrs={"placeholder": "unlimited"}),
            "max_concurrent": forms.NumberInput(attrs={"placeholder": "unlimited"}),
        }
        labels = {"allowed_models": "Models", "allowed_regions": "Gateway regions"}
