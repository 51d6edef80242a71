"""``manage.py seed_demo_key``: the demo client key ``make run`` prints and its demo traffic sends.

Idempotent: the secret lives in ``var/demo-key`` (mode 0600); while a live key matches it, it is
kept. Otherwise (first run, file lost, key revoked or deleted) a new demo key is made. Then the
key set is published to Redis.
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from controlplane.keys.models import ClientKey, hash_secret
from controlplane.keys.publishing import KeyPublishError, publish_keys
from controlplane.private_files import write_private_file

DEMO_KEY_NAME = "demo"


class Command(BaseCommand):
    help = "Ensure the demo client key (secret in var/demo-key) and publish the key set."

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--path", default=str(settings.VAR_DIR / "demo-key"), help="where the secret is kept"
        )

    def handle(self, *args, path: str, **options) -> None:
        secret_path = Path(path)
        secret = secret_path.read_text().strip() if secret_path.exists() else ""
        key = (
            ClientKey.objects.filter(secret_sha256=hash_secret(secret), revoked=False).first()
            if secret
            else None
        )
        if key is None or key.is_expired:
            with transaction.atomic():
                key = ClientKey(name=DEMO_KEY_NAME, owner="demo", team="demo", requests_per_min=6000)
                key.tokens_per_min = 5_000_000
                secret = key.set_new_secret()
                key.save()
            write_private_file(secret_path, secret)
            self.stdout.write(f"Created demo client key {key.key_id}; its secret is in {secret_path}.")
        else:
            self.stdout.write(f"Demo client key {key.key_id} is in place ({secret_path}).")
        try:
            key_set = publish_keys()
        except KeyPublishError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Published {len(key_set.keys)} client key(s) to the gateways.")
