"""``manage.py publish_keys``: write the client key set to Redis again (after a Redis outage)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from controlplane.keys.publishing import KeyPublishError, publish_keys


class Command(BaseCommand):
    help = "Write every client key (hashes only) to Redis and announce it to the gateways."

    def handle(self, *args, **options) -> None:
        try:
            key_set = publish_keys()
        except KeyPublishError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Published {len(key_set.keys)} client key(s), version {key_set.version}.")
