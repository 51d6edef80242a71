"""Whose failure a finished request was: the fleet's, or the client's own (one rule, every aggregate).

The gateway records an ``error`` text with every answer it gives itself, a 401 for a mistyped key
as much as a 502, so the text says nothing about whose fault it was; the status does. A 4xx (the
gateway's own 401, 403, 404, 429, 400s, a client that left: 499, or a node's 4xx) is the client's
mistake. The fleet failed a request it answered 5xx, or whose 2xx stream broke (an error recorded
with a status below 400).
"""

from __future__ import annotations

from routing.contract import RequestRecord


def fleet_failed(record: RequestRecord) -> bool:
    """A 5xx, or no (complete) answer: counted in the error rate."""
    return record.status >= 500 or (record.status < 400 and record.error is not None)


def client_refused(record: RequestRecord) -> bool:
    """A 4xx, whoever answered it: shown apart from the error rate, never in it."""
    return 400 <= record.status < 500
