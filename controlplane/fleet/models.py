from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator, URLValidator
from django.db import models

from controlplane.audit import Audited
from controlplane.fleet.choices import NodeStateChoices

slug_validator = RegexValidator(
    r"^[a-z0-9]+(?:-[a-z0-9]+)*$", "Use lower-case letters, digits and single hyphens (e.g. us-east)."
)
http_url_validator = URLValidator(schemes=["http", "https"])
# What a gateway connects to: a host and port, or vLLM's own bind address "tcp://*:5557", which
# gateways read as the node's host (routing.cache.kv_events.subscriber.connectable).
zmq_endpoint_validator = RegexValidator(
    r"^tcp://(?:\*|[A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\]):[0-9]{1,5}$",
    "Give tcp://HOST:PORT as gateways reach it, or vLLM's tcp://*:PORT (the node's host).",
)


class Region(Audited, models.Model):
    """A geographic region where gateways serve clients and GPU nodes run."""

    slug = models.CharField(max_length=64, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=128)
    latitude = models.FloatField(validators=[MinValueValidator(-90.0), MaxValueValidator(90.0)])
    longitude = models.FloatField(validators=[MinValueValidator(-180.0), MaxValueValidator(180.0)])
    provider = models.CharField(max_length=64, blank=True)
    zone = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class LLMModel(Audited, models.Model):
    """A model the fleet serves, by the name clients send in the OpenAI ``model`` field."""

    name = models.CharField(max_length=200, unique=True)
    kv_block_size = models.PositiveIntegerField(
        default=16, validators=[MinValueValidator(1), MaxValueValidator(1024)]
    )
    max_context_tokens = models.PositiveIntegerField(
        default=32768, validators=[MinValueValidator(16), MaxValueValidator(10_000_000)]
    )
    tokenizer_path = models.CharField(
        max_length=500,
        blank=True,
        help_text="Path of the model's Hugging Face tokenizer.json on the gateway hosts. With it, "
        "gateways match prompts precisely on nodes that publish KV events; without, approximately.",
    )
    chat_template_path = models.CharField(
        max_length=500,
        blank=True,
        help_text="Path of the model's Jinja chat template (Hugging Face format) on the gateway hosts.",
    )
    model_folder = models.CharField(
        max_length=500,
        blank=True,
        help_text="The model's folder on the gateway hosts, as vLLM loads it (tokenizer.json, "
        "tokenizer_config.json with the chat template, config.json). Gives the tokenizer and the "
        "chat template the two paths above leave empty.",
    )
    lora_adapter = models.BooleanField(
        default=False,
        help_text="The name is a LoRA adapter's (vLLM --lora-modules NAME=PATH): vLLM keeps its cached "
        "blocks apart from the base model's, and so do gateways.",
    )

    class Meta:
        # The class was called ``Model`` before; the table keeps its name.
        db_table = "fleet_model"
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        super().clean()
        if self.chat_template_path and not (self.tokenizer_path or self.model_folder):
            raise ValidationError(
                {"tokenizer_path": "A chat template needs the tokenizer it was written for."}
            )


class Node(Audited, models.Model):
    """A vLLM endpoint on a GPU server: where requests are sent."""

    name = models.CharField(max_length=100, unique=True, validators=[slug_validator])
    region = models.ForeignKey(Region, on_delete=models.PROTECT, related_name="nodes")
    base_url = models.CharField(
        max_length=300,
        unique=True,
        validators=[http_url_validator],
        help_text="Where the node's OpenAI API lives, e.g. http://10.0.0.5:8000 (no /v1).",
    )
    served_models = models.ManyToManyField(LLMModel, related_name="nodes", blank=True)
    gpu_type = models.CharField(max_length=64, default="H100")
    gpu_count = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    max_num_seqs = models.PositiveIntegerField(
        default=256, validators=[MinValueValidator(1)], help_text="vLLM --max-num-seqs."
    )
    prefill_tokens_per_s = models.FloatField(
        default=20000.0,
        validators=[MinValueValidator(1.0)],
        help_text="Estimated prefill throughput, tokens per second.",
    )
    kv_capacity_tokens = models.PositiveIntegerField(
        default=500_000, validators=[MinValueValidator(16)], help_text="KV-cache capacity in tokens."
    )
    state = models.CharField(max_length=16, choices=NodeStateChoices.choices, default=NodeStateChoices.ACTIVE)
    labels = models.JSONField(default=dict, blank=True)
    kv_events_endpoint = models.CharField(
        max_length=300,
        blank=True,
        validators=[zmq_endpoint_validator],
        help_text="Where gateways subscribe to the node's vLLM KV-cache events: its --kv-events-config "
        "endpoint when vLLM binds it (tcp://*:5557, read as the node's host), else the publish "
        "endpoint of the gorgo relay that binds it (python -m routing.cache.kv_relay). Empty: "
        "routed on the approximate prefix index.",
    )
    kv_events_replay_endpoint = models.CharField(
        max_length=300,
        blank=True,
        validators=[zmq_endpoint_validator],
        help_text="The node's replay_endpoint as gateways reach it (optional; fills sequence gaps).",
    )
    kv_events_topic = models.CharField(
        max_length=100, blank=True, help_text="The events' ZMQ topic (vLLM's topic)."
    )
    created = models.DateTimeField(auto_now_add=True)
    last_updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["region__slug", "name"]

    def __str__(self) -> str:
        return self.name

    def set_state(self, state: NodeStateChoices) -> bool:
        """Move the node to ``state`` (drain/enable); False when it already was, nothing saved.

        A plain save, not a queryset update, so the fleet-change signal republishes the policy.
        """
        if self.state == state:
            return False
        self.state = state
        self.save(update_fields=["state", "last_updated"])
        return True

    def clean(self) -> None:
        super().clean()
        if self.base_url:
            self.base_url = self.base_url.rstrip("/")
            if self.base_url.endswith("/v1"):
                raise ValidationError({"base_url": "Give the server root, without the trailing /v1."})
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValidationError({"kv_events_endpoint": "A replay endpoint needs the events endpoint."})
        if not isinstance(self.labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.labels.items()
        ):
            raise ValidationError({"labels": "Labels must be an object of string keys to string values."})
