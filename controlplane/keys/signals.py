"""Publish the key set whenever a key (or a model/region name it refers to) changes, after commit."""

from __future__ import annotations

from django.db.models.signals import m2m_changed, post_delete, post_save
from django.dispatch import receiver

from controlplane.fleet.models import LLMModel, Region
from controlplane.keys.models import ClientKey
from controlplane.keys.publishing import publish_keys_on_commit


@receiver(post_save, sender=ClientKey)
def _key_saved(sender, instance, created, raw=False, update_fields=None, **kwargs) -> None:
    if raw or (update_fields is not None and set(update_fields) <= {"last_used_at"}):
        return
    publish_keys_on_commit(f"key {instance.key_id} {'added' if created else 'changed'}")


@receiver(post_delete, sender=ClientKey)
def _key_deleted(sender, instance, **kwargs) -> None:
    publish_keys_on_commit(f"key {instance.key_id} deleted")


@receiver(m2m_changed, sender=ClientKey.allowed_models.through)
@receiver(m2m_changed, sender=ClientKey.allowed_regions.through)
def _key_scope_changed(sender, instance, action, **kwargs) -> None:
    if action in ("post_add", "post_remove", "post_clear"):
        publish_keys_on_commit("key scope changed")


@receiver(post_save, sender=LLMModel)
@receiver(post_save, sender=Region)
def _name_changed(sender, instance, created, raw=False, **kwargs) -> None:
    if not raw and not created and instance.client_keys.exists():
        publish_keys_on_commit(f"{sender.__name__.lower()} {instance} renamed")
