"""Probe workers follow the regions: no restart for a region added later, no queue piling up.

A worker that probes (it consumes some ``probe.<region>`` queue, or ``GORGO_PROBE_REGIONS`` is
set) runs a ``ProbeQueueFollower`` thread from ``worker_ready``. Every probe interval it

- starts consuming the probe queue of each region it should probe and does not yet (all regions
  for ``GORGO_PROBE_REGIONS=*``, the named ones otherwise), through Celery's own remote control
  (``add_consumer``), so the worker's event loop makes the change; and
- marks each region it consumes as covered (``RedisKeys.probe_consumer``, expiring after three
  intervals).

``probe_fanout`` enqueues probes only for covered regions: a region no worker probes from gets
no messages, instead of a queue that grows until someone notices (docs/telemetry.md).
"""

from __future__ import annotations

import logging
import threading

import redis
from celery.signals import worker_ready, worker_shutdown
from django.conf import settings
from django.db import close_old_connections

from controlplane.connections import redis_client, redis_keys
from controlplane.fleet.models import Region

log = logging.getLogger(__name__)

PROBE_QUEUE_PREFIX = "probe."
# A covered mark outlives this many missed refreshes (a busy or restarting worker) before the
# fan-out stops sending to the region.
COVERED_FOR_INTERVALS = 3


def probe_queue(region_slug: str) -> str:
    return f"{PROBE_QUEUE_PREFIX}{region_slug}"


def covered_regions(client: redis.Redis, slugs: list[str]) -> set[str]:
    """The regions some worker consumes the probe queue of, right now."""
    if not slugs:
        return set()
    keys = redis_keys()
    flags = client.mget([keys.probe_consumer(slug) for slug in slugs])
    return {slug for slug, flag in zip(slugs, flags, strict=True) if flag is not None}


class ProbeQueueFollower(threading.Thread):
    """Keeps one worker consuming the probe queues it should, and says which ones it covers."""

    def __init__(self, app, hostname: str, consumed: set[str], wanted: str, interval_s: float) -> None:
        super().__init__(name="probe-queue-follower", daemon=True)
        self.app = app
        self.hostname = hostname
        self.consumed = set(consumed)
        self.wanted = {slug.strip() for slug in wanted.split(",") if slug.strip()}
        self.interval_s = interval_s
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.sync()
            except Exception:
                log.exception("probe queue follower: round failed")
            self.stopping.wait(self.interval_s)

    def sync(self) -> None:
        try:
            regions = set(Region.objects.values_list("slug", flat=True))
        finally:
            close_old_connections()
        targets = regions if "*" in self.wanted else regions & self.wanted
        for slug in sorted(targets - self.consumed):
            self.app.control.add_consumer(probe_queue(slug), destination=[self.hostname])
            self.consumed.add(slug)
            log.info("probing from %s now (queue %s added without a restart)", slug, probe_queue(slug))
        client, keys = redis_client(), redis_keys()
        ttl_s = max(1, round(self.interval_s * COVERED_FOR_INTERVALS))
        pipe = client.pipeline(transaction=False)
        for slug in sorted(self.consumed & regions):
            pipe.set(keys.probe_consumer(slug), self.hostname, ex=ttl_s)
        pipe.execute()


_followers: list[ProbeQueueFollower] = []


@worker_ready.connect
def _start_follower(sender, **kwargs) -> None:
    consumer = sender
    consumed = {
        queue.name.removeprefix(PROBE_QUEUE_PREFIX)
        for queue in consumer.task_consumer.queues
        if queue.name.startswith(PROBE_QUEUE_PREFIX)
    }
    if not consumed and not settings.GORGO_PROBE_REGIONS:
        return  # not a probe worker
    follower = ProbeQueueFollower(
        consumer.app,
        consumer.hostname,
        consumed,
        settings.GORGO_PROBE_REGIONS,
        settings.GORGO_PROBE_INTERVAL_S,
    )
    _followers.append(follower)
    follower.start()


@worker_shutdown.connect
def _stop_followers(**kwargs) -> None:
    for follower in _followers:
        follower.stopping.set()
