"""Settings for the test suite: the real settings, with a Redis namespace of this run's own.

Every pytest process gets a unique GORGO_REDIS_PREFIX, so concurrent runs (and processes the
tests start, which inherit the environment) share one Redis server without touching each
other's keys; tests/conftest.py deletes the namespace at the end.
"""

from __future__ import annotations

import os
import uuid

os.environ.setdefault("DEBUG", "true")
# Fleet changes republish at once in tests (the coalescing tests set a delay of their own).
os.environ.setdefault("GORGO_REPUBLISH_DELAY_S", "0")
os.environ.setdefault("GORGO_REDIS_PREFIX", f"gorgotest-{os.getpid()}-{uuid.uuid4().hex[:8]}")

from controlplane.settings import *  # noqa: F403
