"""What this gateway's region has paid, per prompt prefix, for having it cached only abroad.

The trap (docs/routing.md, "Bringing a prefix home"): a region's prompt family (a system prompt
its clients keep sending) gets cached on a node in another region, by a cold start, an outage or
an early overflow, and never at home. Every later request of the family is then cheaper abroad
(a round trip against the whole prefix's prefill at home), so each goes abroad, the prefix never
gets cached at home, and the region's clients pay the round trip on every request for as long as
the family lives. Each decision is right for its own request; together they are wrong.

gorgo's way out is ski rental: each such forward *pays rent* (what the request would have saved
at home had the prefix been cached there), and once a prefix's rent reaches a multiple of what
bringing it home costs (one request prefilling it at home, and the wait that prefill adds for the
home region's next arrivals), one request of the family stays home and pays that price instead;
the family's later requests find the prefix at home. Buying at the break-even point of rent and
price is the classic 2-competitive strategy when nobody knows how long the family will live.

This is the gateway's bookkeeping of that rent; the decision is gorgo's
(``routing.algorithms.gorgo``), which reads ``owed`` through the view and returns what its
decision paid or bought (``Decision.rent_keys`` / ``rent_ms`` / ``homed``); the gateway applies it
here after the live decision (never a shadow's). A prefix is keyed by chained chunk hashes
(``routing.cache.approx_index.chunk_hashes``) at several depths of what the node abroad holds of it
(``PrefixRent.keys``): the deepest is the request's own (its conversation's history too), the
shallower ones its family's (the system prompt its region's requests share), so the rent of a
family's many conversations adds up where it belongs.
Rent fades with a half-life, so a family that stopped (or a burst long ago) does not buy later.
No I/O and no clock of its own: whoever routes calls ``fade_to`` with its time before a decision
reads ``owed`` (at most one fade a second does any work).
"""

from __future__ import annotations

from typing import Final

# Rent halves every this many seconds without new payments: a family that keeps sending keeps
# its debt, one that stopped a few minutes ago is forgotten.
RENT_HALF_LIFE_S: Final = 60.0
# Below this much rent (ms) a prefix is dropped from the ledger.
RENT_FORGET_MS: Final = 1.0
# Prefixes kept at most; past it the smallest debts go (a bound against prompts that never repeat).
MAX_PREFIXES: Final = 4096
# Debts fade in steps of at least this many seconds (one pass over the ledger each).
FADE_STEP_S: Final = 1.0


class HomingLedger:
    """Prefix key -> rent paid (ms of TTFT the region's requests lost to it being cached abroad)."""

    __slots__ = ("_faded_at_s", "owed")

    def __init__(self) -> None:
        # Read by gorgo through the view (``PrefixRent.owed``); written only here.
        self.owed: dict[int, float] = {}
        self._faded_at_s: float | None = None

    def pay(self, keys: tuple[int, ...], rent_ms: float) -> None:
        """A forward for the prefix ``keys`` name paid ``rent_ms`` (each key owes it)."""
        owed = self.owed
        for key in keys:
            owed[key] = owed.get(key, 0.0) + rent_ms
        if len(owed) > MAX_PREFIXES:
            self._shrink()

    def settle(self, keys: tuple[int, ...]) -> None:
        """A request stayed home to cache the prefix ``keys`` name: their debts are paid."""
        owed = self.owed
        for key in keys:
            owed.pop(key, None)

    def fade_to(self, now_s: float) -> None:
        """Fade every debt by the half-life for the time since the last fade (``now_s``: the
        caller's monotonic seconds); nothing to do within ``FADE_STEP_S`` of it."""
        last = self._faded_at_s
        if last is None or not self.owed:
            self._faded_at_s = now_s
            return
        elapsed_s = now_s - last
        if elapsed_s < FADE_STEP_S:
            return
        self._faded_at_s = now_s
        factor = 0.5 ** (elapsed_s / RENT_HALF_LIFE_S)
        self.owed = {key: ms * factor for key, ms in self.owed.items() if ms * factor >= RENT_FORGET_MS}

    def _shrink(self) -> None:
        # Keep the larger half: those are the families close to coming home.
        kept = sorted(self.owed.items(), key=lambda item: item[1], reverse=True)[: MAX_PREFIXES // 2]
        self.owed = dict(kept)
