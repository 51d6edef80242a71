"""Settings for the test suite: the real settings, with a Redis namespace of this run's own.

Every pytest process (each xdist worker too) gets a unique GORGO_REDIS_PREFIX, so concurrent runs
(and processes the tests start, which inherit the environment) share one Redis server without
touching each other's keys; tests/conftest.py deletes the namespace at the end.
"""

from __future__ import annotations

import os
import uuid

os.environ.setdefault("DEBUG", "true")
# Fleet changes republish at once in tests (the coalescing tests set a delay of their own).
os.environ.setdefault("GORGO_REPUBLISH_DELAY_S", "0")
os.environ.setdefault("GORGO_REDIS_PREFIX", f"gorgotest-{os.getpid()}-{uuid.uuid4().hex[:8]}")
# pytest-xdist's workers inherit the environment of the process that started them, where the line
# above already ran: each worker takes a namespace of its own, or one worker's dashboard sockets
# receive another's pushes and their Celery workers share one queue. Only the worker itself: the
# processes its tests start inherit its marker and keep the prefix their test gave them.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER and os.environ.get("GORGO_TEST_PREFIX_OF") != _WORKER:
    os.environ["GORGO_REDIS_PREFIX"] = f"gorgotest-{os.getpid()}-{uuid.uuid4().hex[:8]}-{_WORKER}"
    os.environ["GORGO_TEST_PREFIX_OF"] = _WORKER

from controlplane.settings import *  # noqa: E402, F403
