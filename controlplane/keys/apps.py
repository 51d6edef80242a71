from __future__ import annotations

from django.apps import AppConfig


class KeysConfig(AppConfig):
    name = "controlplane.keys"
    label = "keys"
    verbose_name = "Client keys"

    def ready(self) -> None:
        from controlplane import reconcile
        from controlplane.keys import signals  # noqa: F401  (connects key-set republish)
        from controlplane.keys.publishing import restore_keys

        reconcile.register("client keys", restore_keys)
