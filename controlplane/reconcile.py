"""One reconcile for everything the gateways read from Redis that the control plane writes.

Redis may lose its data (a failover to an empty replica, a restart without persistence) or miss
a write (unreachable when a change committed). The database is the source: each app that writes a
document the gateways read registers a *restorer* here, which compares what Redis holds with the
database and writes it again when it differs. The periodic ``policies.reconcile`` task runs them
all (every ``GORGO_RECONCILE_INTERVAL_S``). Today: the policy snapshot (``policies``) and the client
key set (``keys``); live node state and the RTT table are rewritten by every scrape and probe
round, and the gateways' own keys (load, prefix updates, KV state, limits) by the gateways.

Core knows no app: apps register in their ``AppConfig.ready``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

# A restorer returns what it did in a few words (logged), or None when Redis already held it.
Restorer = Callable[[], str | None]

_RESTORERS: dict[str, Restorer] = {}


def register(name: str, restorer: Restorer) -> None:
    """Run ``restorer`` on every reconcile pass (registering the same name again replaces it)."""
    _RESTORERS[name] = restorer


def restore_all() -> dict[str, str | None]:
    """Run every restorer; one that fails (Redis away) does not keep the others from running."""
    done: dict[str, str | None] = {}
    for name, restorer in _RESTORERS.items():
        try:
            done[name] = restorer()
        except Exception as exc:  # the next pass tries again; the other restorers still run
            log.warning("reconcile %s: not restored, trying again next pass: %s", name, exc)
            done[name] = f"failed: {type(exc).__name__}"
            continue
        if done[name] is not None:
            log.info("reconcile %s: %s", name, done[name])
    return done
