"""Files only their owner may read (mode 0600): the demo's API token and client key under ``var/``."""

from __future__ import annotations

import os
from pathlib import Path


def write_private_file(path: Path, text: str) -> None:
    """Write ``text`` and a newline to ``path``, created (or truncated) with mode 0600.

    The mode is set at creation, so the secret is never readable by others, even for a moment; a
    file that existed with a wider mode is narrowed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text + "\n")
    os.chmod(path, 0o600)
