"""Compile the gateway's hot modules with mypyc (routing/native.py), reusing a build of the same sources.

Run by ``make run`` and ``make test``. Without a C compiler or mypy it says so and exits 0: the
gateway then runs its pure-Python modules.
"""

from __future__ import annotations

import sys
import time

from routing import native


def main() -> int:
    started_s = time.monotonic()
    try:
        target = native.build()
    except (Exception, SystemExit) as exc:  # mypyc exits on type errors; either way run pure Python
        print(
            f"routing.native: not compiled ({exc!r}); the gateway runs its pure-Python modules",
            file=sys.stderr,
        )
        return 0
    print(
        f"routing.native: {len(native.MODULES)} modules compiled in {target} "
        f"({time.monotonic() - started_s:.1f} s, 0 when reused)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
