"""The policy form: errors next to the field that caused them, nothing saved on error, edits audited."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.test import Client

from controlplane.policies.models import RoutingPolicy
from tests.dashboard.conftest import LLAMA, Fleet


def form_data(**overrides) -> dict:
    data = {
        "name": "default",
        "description": "",
        "algorithm": "gorgo",
        "param_gorgo_w_rtt": "1.0",
        "param_gorgo_w_queue": "1.0",
        "param_gorgo_default_rtt_ms": "100",
        "param_gorgo_chars_per_token": "4",
        "max_rtt_ms": "",
    }
    data.update(overrides)
    return data


@pytest.mark.django_db
def test_it_shows_a_parameter_error_next_to_the_parameter(
    operator_client: Client, policy: RoutingPolicy
) -> None:
    response = operator_client.post(f"/policies/{policy.pk}/edit/", form_data(param_gorgo_w_rtt="500"))
    assert response.status_code == 200
    form = response.context["form"]
    assert form.errors == {"param_gorgo_w_rtt": ["Must be at most 100."]}
    assert "Not saved." in response.content.decode()
    policy.refresh_from_db()
    assert policy.params == {"w_rtt": 1.0}
    assert not LogEntry.objects.exists()


@pytest.mark.django_db
def test_it_rejects_a_maximum_rtt_out_of_range(operator_client: Client, policy: RoutingPolicy) -> None:
    response = operator_client.post(f"/policies/{policy.pk}/edit/", form_data(max_rtt_ms="-5"))
    assert response.context["form"].errors == {"max_rtt_ms": ["Maximum RTT must be between 0 and 10000 ms."]}


@pytest.mark.django_db
def test_it_rejects_text_where_a_number_belongs(operator_client: Client, policy: RoutingPolicy) -> None:
    response = operator_client.post(f"/policies/{policy.pk}/edit/", form_data(param_gorgo_w_queue="lots"))
    assert response.context["form"].errors == {"param_gorgo_w_queue": ["Enter a number."]}


@pytest.mark.django_db
def test_it_saves_a_valid_edit_and_records_who_changed_what(
    operator_client: Client, policy: RoutingPolicy, fleet: Fleet, operator
) -> None:
    data = form_data(
        param_gorgo_w_rtt="2.5",
        max_rtt_ms="300",
        model_scope=[str(fleet.model.pk)],
        **{"residency_eu-central": ["eu-central"]},
    )
    response = operator_client.post(f"/policies/{policy.pk}/edit/", data)
    assert response.status_code == 302
    assert response["Location"] == f"/policies/{policy.pk}/"
    policy.refresh_from_db()
    assert policy.params == {"w_rtt": 2.5}  # defaults are left to the contract
    assert policy.max_rtt_ms == 300.0
    assert policy.residency == [{"client_region": "eu-central", "node_regions": ["eu-central"]}]
    assert list(policy.model_scope.values_list("name", flat=True)) == [LLAMA]
    entry = LogEntry.objects.get()
    assert entry.user == operator.user
    assert entry.action_flag == CHANGE
    assert entry.object_id == str(policy.pk)
    assert entry.change_message == (
        "params.w_rtt: 1.0 -> 2.5; model_scope: [] -> ['meta-llama/Llama-3.1-8B-Instruct']; "
        "residency: [] -> [{'client_region': 'eu-central', 'node_regions': ['eu-central']}]; max_rtt_ms: None -> 300.0"
    )


@pytest.mark.django_db
def test_it_only_keeps_the_parameters_of_the_chosen_algorithm(
    operator_client: Client, policy: RoutingPolicy
) -> None:
    data = form_data(algorithm="prefix_affinity", param_prefix_affinity_cache_threshold="0.5")
    assert operator_client.post(f"/policies/{policy.pk}/edit/", data).status_code == 302
    policy.refresh_from_db()
    assert policy.algorithm == "prefix_affinity"
    assert policy.params == {"cache_threshold": 0.5}


@pytest.mark.django_db
def test_it_creates_a_policy_as_a_draft(operator_client: Client, fleet: Fleet, operator) -> None:
    response = operator_client.post("/policies/new/", form_data(name="latency-first", algorithm="least_load"))
    created = RoutingPolicy.objects.get(name="latency-first")
    assert response["Location"] == f"/policies/{created.pk}/"
    assert created.is_active is False
    assert created.versions.count() == 0
    entry = LogEntry.objects.get()
    assert (entry.action_flag, entry.user, entry.change_message) == (ADDITION, operator.user, "created")


@pytest.mark.django_db
def test_it_renders_the_residency_grid_with_the_saved_rules(
    operator_client: Client, policy: RoutingPolicy
) -> None:
    policy.residency = [{"client_region": "ap-south", "node_regions": ["ap-south", "eu-central"]}]
    policy.save()
    html = operator_client.get(f"/policies/{policy.pk}/edit/").content.decode()
    assert (
        'name="residency_ap-south" value="eu-central" aria-label="ap-south may use eu-central" checked'
        in html
    )
    assert 'name="residency_us-east" value="eu-central" aria-label="us-east may use eu-central">' in html


@pytest.mark.django_db
def test_it_shows_each_bad_parameter_next_to_its_own_input(
    operator_client: Client, policy: RoutingPolicy
) -> None:
    data = form_data(param_gorgo_w_rtt="500", param_gorgo_default_rtt_ms="-1")
    response = operator_client.post(f"/policies/{policy.pk}/edit/", data)
    assert response.context["form"].errors == {
        "param_gorgo_w_rtt": ["Must be at most 100."],
        "param_gorgo_default_rtt_ms": ["Must be at least 0."],
    }


@pytest.mark.django_db
def test_it_records_nothing_when_only_defaults_were_spelled_out(
    operator_client: Client, policy: RoutingPolicy
) -> None:
    # The stored {"w_rtt": 1.0} is the default: submitting the form unchanged is no change.
    response = operator_client.post(f"/policies/{policy.pk}/edit/", form_data(), follow=True)
    assert [str(m) for m in response.context["messages"]] == ["Nothing changed."]
    assert not LogEntry.objects.exists()


@pytest.mark.django_db
def test_it_edits_a_yes_or_no_parameter(operator_client: Client, policy: RoutingPolicy) -> None:
    """gorgo's ``measured_inputs``: "no" is saved, "yes" (the default) and "(default)" leave it to the
    contract, anything else is refused next to the field; the form shows what is saved."""
    no = form_data(param_gorgo_measured_inputs="false")
    assert operator_client.post(f"/policies/{policy.pk}/edit/", no).status_code == 302
    policy.refresh_from_db()
    assert policy.params == {"measured_inputs": False}  # w_rtt 1.0 is the default: left out
    html = operator_client.get(f"/policies/{policy.pk}/edit/").content.decode()
    assert '<option value="false" selected>no</option>' in html
    for default in ("true", ""):
        data = form_data(param_gorgo_measured_inputs=default)
        assert operator_client.post(f"/policies/{policy.pk}/edit/", data).status_code == 302
        policy.refresh_from_db()
        assert "measured_inputs" not in policy.params
    response = operator_client.post(
        f"/policies/{policy.pk}/edit/", form_data(param_gorgo_measured_inputs="maybe")
    )
    assert response.status_code == 200
    assert list(response.context["form"].errors) == ["param_gorgo_measured_inputs"]
