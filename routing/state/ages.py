"""How old a shared entry is, as this reader can tell when the writer's clock runs ahead.

Live node entries (telemetry workers) and peer load reports (other gateways) carry their writer's
unix time, and readers drop an entry once it is older than a limit, so a writer that stopped stops
counting. A writer whose clock runs ahead stamps entries in the reader's future: by its stamp such
an entry stays young for as long as the clock is ahead after its writer stopped (an hour of skew,
an hour of a dead worker's "unhealthy" mark or a dead gateway's load). So an entry's age here is
the larger of its stamp's age and the time since this reader first saw that stamp: a live writer
changes its stamp at every write, and one that stopped ages from when its last stamp arrived.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class EntryAges:
    """Entry key -> (its stamp, when this reader first saw that stamp); ``age_s`` per read."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[Hashable, tuple[float, float]] = {}

    def age_s(self, key: Hashable, stamp_s: float, now_s: float) -> float:
        """The entry's age: ``now_s - stamp_s``, or longer if that stamp arrived longer ago."""
        seen = self._seen.get(key)
        if seen is None or seen[0] != stamp_s:
            self._seen[key] = (stamp_s, now_s)
            return now_s - stamp_s
        return max(now_s - stamp_s, now_s - seen[1])

    def keep(self, keys: Iterable[Hashable]) -> None:
        """Forget the entries not among ``keys`` (gone from the shared state)."""
        wanted = set(keys)
        for key in [key for key in self._seen if key not in wanted]:
            del self._seen[key]
