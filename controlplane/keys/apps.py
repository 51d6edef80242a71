from __future__ import annotations

from django.apps import AppConfig


class KeysConfig(AppConfig):
    name = "controlplane.keys"
    label = "keys"
    verbose_name = "Client keys"

    def ready(self) -> None:
        from controlplane.keys import signals  # noqa: F401  (connects key-set republish)
