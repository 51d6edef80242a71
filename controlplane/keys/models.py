"""Client API keys: who may use the gateways, for which models and regions, how much and how fast."""

from __future__ import annotations

import hashlib
import secrets

from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from controlplane.audit import Audited
from controlplane.fleet.models import LLMModel, Region
from controlplane.keys.choices import PriorityChoices

SECRET_PREFIX = "gorgo-sk-"
_ID_BYTES = 4  # the public id: 8 hex characters, shown in lists, logs and metrics
_SECRET_BYTES = 32  # 256 bits of entropy: a plain sha256 is then a safe way to store it


def new_key_id() -> str:
    return secrets.token_hex(_ID_BYTES)


def new_secret(key_id: str) -> str:
    """``gorgo-sk-<id>-<random>``: the id part lets a reader tell keys apart without the secret."""
    return f"{SECRET_PREFIX}{key_id}-{secrets.token_urlsafe(_SECRET_BYTES)}"


def hash_secret(secret: str) -> str:
    """The stored form of a secret. The secret is high-entropy, so no slow KDF is needed."""
    return hashlib.sha256(secret.encode()).hexdigest()


class ClientKey(Audited, models.Model):
    """A client's API key for the gateways. The secret is shown once; only its hash is kept."""

    key_id = models.CharField(max_length=16, unique=True, editable=False, default=new_key_id)
    # blank: set by set_new_secret() (or the API) rather than a form; save() refuses an empty one.
    secret_sha256 = models.CharField(max_length=64, unique=True, editable=False, blank=True)
    name = models.CharField(max_length=100, help_text="What the key is for, e.g. 'search-backend'.")
    owner = models.CharField(max_length=100, help_text="Who answers for the key (person or service).")
    team = models.CharField(max_length=100, blank=True)
    allowed_models = models.ManyToManyField(
        LLMModel, related_name="client_keys", blank=True, help_text="None selected: every model."
    )
    allowed_regions = models.ManyToManyField(
        Region,
        related_name="client_keys",
        blank=True,
        help_text="Gateway regions the key may be used in. None selected: every region.",
    )
    requests_per_min = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Empty: unlimited."
    )
    tokens_per_min = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Prompt + completion tokens. Empty: unlimited.",
    )
    max_concurrent = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Open requests at once, across every gateway. Empty: unlimited.",
    )
    priority = models.CharField(
        max_length=16, choices=PriorityChoices.choices, default=PriorityChoices.INTERACTIVE
    )
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Empty: never expires.")
    revoked = models.BooleanField(default=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_used_at = models.DateTimeField(
        null=True, blank=True, editable=False, help_text="As the gateways reported it (to about a minute)."
    )
    created = models.DateTimeField(auto_now_add=True)
    last_updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name", "key_id"]
        verbose_name = "client key"

    def __str__(self) -> str:
        return f"{self.name} ({self.key_id})"

    def save(self, *args, **kwargs) -> None:
        if not self.secret_sha256:
            raise ValueError("a client key needs a secret: call set_new_secret() first")
        super().save(*args, **kwargs)

    @property
    def prefix(self) -> str:
        """What a secret of this key starts with: enough to recognise it, useless to use it."""
        return f"{SECRET_PREFIX}{self.key_id}-"

    def set_new_secret(self) -> str:
        """Give the key a new secret (create, rotate); return it. Only the hash is stored."""
        secret = new_secret(self.key_id)
        self.secret_sha256 = hash_secret(secret)
        return secret

    def revoke(self) -> None:
        if not self.revoked:
            self.revoked = True
            self.revoked_at = timezone.now()
            self.save(update_fields=["revoked", "revoked_at", "last_updated"])

    @property
    def is_expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()
