"""The gateway's view of its nodes' KV-event modes, reported to Redis for the dashboard."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from routing.background import Flag, sleep_unless
from routing.cache.kv_events.manager import KVEvents
from routing.contract import RedisKeys, encode

logger = logging.getLogger("routing.kv_events")

STATE_INTERVAL_S = 2.0  # how often a gateway reports its nodes' modes for the dashboard


async def report_kv_state(
    events: KVEvents, redis: Any, keys: RedisKeys, gateway_id: str, region: str, stop: Flag
) -> None:
    """Every ``STATE_INTERVAL_S``, HSET this gateway's view of ``events`` (best effort; until ``stop``)."""
    failing = False
    reported = False
    while not await sleep_unless(stop, STATE_INTERVAL_S):
        if not (events.subscribers or reported):
            continue  # nothing to report (no node publishes events)
        try:
            async with asyncio.timeout(STATE_INTERVAL_S):
                await redis.hset(keys.kv_state, gateway_id, encode(events.state(gateway_id, region)))
            reported = True
            failing = False
        except Exception as exc:  # Redis down: the dashboard shows no mode meanwhile
            if not failing:
                logger.warning("cannot report KV-index state to Redis: %s", exc)
            failing = True
    if reported:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await redis.hdel(keys.kv_state, gateway_id)
