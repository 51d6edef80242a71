"""Fixtures for the gateway tests: an asyncio Redis client and vLLM-like stub nodes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from tests.routing.support import StubNode, stub_nodes


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def stubs() -> AsyncIterator[list[StubNode]]:
    """Two stub nodes, ``a`` and ``b``."""
    async with stub_nodes("a", "b") as nodes:
        yield nodes
