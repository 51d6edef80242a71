"""``manage.py seed_demo``: the demo fleet, a published ``gorgo`` policy and an operator. Idempotent.

The fleet is the simulator's demo topology (``simulator/topologies/default.toml``), so the nodes the
control plane knows are the ones ``make run`` starts. Running it again changes nothing; fields an
operator manages (a node's state, labels) are never reset, topology fields are brought back in line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import models, transaction

from controlplane.accounts import OPERATORS, ensure_account
from controlplane.fleet.management.commands.createoperator import write_account
from controlplane.fleet.models import LLMModel, Node, Region
from controlplane.policies.choices import AlgorithmChoices
from controlplane.policies.models import RoutingPolicy
from controlplane.policies.publishing import PublishError, publish
from controlplane.private_files import write_private_file
from simulator.model_folder import MODEL_FILES_DIR
from simulator.topology import DEFAULT_TOPOLOGY_PATH, NodeSpec, Topology, TopologyError, load_topology

POLICY_NAME = "default"
POLICY_DESCRIPTION = "The demo policy: GORGO's cost model (network + queue + uncached prefill)."


class Command(BaseCommand):
    help = "Seed the demo fleet, publish the default gorgo policy and ensure an operator. Idempotent."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--topology", default=str(DEFAULT_TOPOLOGY_PATH), help="topology TOML file")
        parser.add_argument("--username", default="operator", help="operator account (default: operator)")
        parser.add_argument(
            "--token-file",
            default="",
            help="keep the operator's API token in this file (mode 0600); `make run` uses var/api-token",
        )

    def handle(self, *args, topology: str, username: str, token_file: str, **options) -> None:
        try:
            fleet = load_topology(Path(topology))
        except TopologyError as exc:
            raise CommandError(str(exc)) from None
        try:
            with transaction.atomic():
                changed = sync_fleet(fleet)
                demo_policy, _created = RoutingPolicy.objects.get_or_create(
                    name=POLICY_NAME,
                    defaults={"algorithm": AlgorithmChoices.GORGO, "description": POLICY_DESCRIPTION},
                )
        except ValidationError as exc:
            raise CommandError(f"The demo fleet conflicts with what is in the database: {exc}") from None
        self.stdout.write(
            f"Fleet {fleet.name}: {len(fleet.regions)} regions, {len(fleet.nodes)} nodes "
            f"({changed} object(s) created or updated)."
        )

        # Keep the operator's choice of active policy; only a fresh install gets the demo policy.
        policy = RoutingPolicy.objects.filter(is_active=True).first() or demo_policy
        try:
            result = publish(policy, note="seed_demo")
        except PublishError as exc:
            raise CommandError(f"{exc}. The fleet is saved; start Redis and run seed_demo again.") from None
        state = "published as" if result.created else "already live as"
        self.stdout.write(f"Policy {policy.name!r} {state} version {result.version.number}.")

        try:
            account = ensure_account(username, password=os.environ.get("GORGO_OPERATOR_PASSWORD") or None)
        except ValidationError as exc:
            raise CommandError(f"GORGO_OPERATOR_PASSWORD rejected: {' '.join(exc.messages)}") from None
        write_account(self, account, group=OPERATORS)
        if token_file:
            # Kept like the password (var/operator-password): the banner scrolls away within seconds.
            write_private_file(Path(token_file), account.token)
            self.stdout.write(f"API token kept in {token_file}:  TOKEN=$(cat {token_file})")


def sync_fleet(fleet: Topology) -> int:
    """Create or update the topology's regions, models and nodes; return how many changed."""
    changed = 0
    regions: dict[str, Region] = {}
    for spec in fleet.regions:
        regions[spec.slug], was_changed = _upsert(
            Region,
            {"slug": spec.slug},
            {"name": spec.name, "latitude": spec.latitude, "longitude": spec.longitude},
        )
        changed += was_changed
    served: dict[str, LLMModel] = {}
    for node in fleet.nodes:
        if node.model not in served:
            served[node.model], was_changed = _upsert(
                LLMModel,
                {"name": node.model},
                {
                    "kv_block_size": node.engine.block_size,
                    "max_context_tokens": node.engine.max_model_len,
                    # The emulated model's folder (tokenizer.json, tokenizer_config.json with the
                    # chat template), as a real model's is given.
                    "model_folder": str(MODEL_FILES_DIR),
                    "tokenizer_path": "",
                    "chat_template_path": "",
                },
            )
            changed += was_changed
    for spec in fleet.nodes:
        node, was_changed = _upsert(
            Node,
            {"name": spec.name},
            {
                "region": regions[spec.region],
                "base_url": spec.url,
                "gpu_type": spec.gpu_type,
                "gpu_count": spec.gpu_count,
                "max_num_seqs": spec.engine.max_num_seqs,
                "prefill_tokens_per_s": spec.engine.prefill_tokens_per_s,
                "kv_capacity_tokens": spec.engine.kv_capacity_tokens,
                **_kv_events_fields(spec),
            },
        )
        changed += was_changed
        if not node.served_models.filter(pk=served[spec.model].pk).exists():
            node.served_models.add(served[spec.model])
            changed += not was_changed
    return changed


def _kv_events_fields(spec: NodeSpec) -> dict[str, str]:
    """The node's KV-event endpoints as gateways reach them (its bind address with "*" resolved)."""
    config = spec.kv_events
    if config is None or not config.enabled:
        return {"kv_events_endpoint": "", "kv_events_replay_endpoint": "", "kv_events_topic": ""}

    def reachable(endpoint: str | None) -> str:
        if not endpoint:
            return ""
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        return f"tcp://{spec.host if host in ('*', '0.0.0.0', '') else host}:{port}"

    return {
        "kv_events_endpoint": reachable(config.endpoint),
        "kv_events_replay_endpoint": reachable(config.replay_endpoint),
        "kv_events_topic": config.topic,
    }


def _upsert(model: type[models.Model], lookup: dict[str, Any], values: dict[str, Any]) -> tuple[Any, bool]:
    """Get by ``lookup``; create it, or save only the ``values`` that differ (so a re-run saves nothing)."""
    obj = model.objects.filter(**lookup).first()
    if obj is None:
        obj = model(**lookup, **values)
    else:
        values = {name: value for name, value in values.items() if getattr(obj, name) != value}
        if not values:
            return obj, False
        for name, value in values.items():
            setattr(obj, name, value)
    obj.full_clean()
    obj.save()
    return obj, True
