"""One request on its way through the gateway: what it accumulates for its record and metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from routing.cache.parsed import ParsedRequest
from routing.contract import ClientKeySpec
from routing.frontdoor.front_door import Grant
from routing.http.usage import Usage
from routing.resilience.retry import Attempt
from routing.state.table import RoutingTable

if TYPE_CHECKING:
    from routing.proxy.shadow import ShadowOutcome


class Exchange(Attempt):
    """Everything one request accumulates on its way through, for the record and the metrics.

    Slots, not a dataclass: one is built per request on the hot path, and the retry loop (its
    ``Attempt`` part), the relay and the outcome each fill in their part of it.
    """

    __slots__ = (
        "arm",
        "arrival_s",
        "bytes_out",
        "canary_id",
        "error",
        "finished",
        "grant",
        "key",
        "parsed",
        "prefix_hashes",
        "prompt_tokens_est",
        "refused_key",
        "request_id",
        "response_started",
        "routing_s",
        "shadow",
        "span",
        "status",
        "stream",
        "table",
        "ts",
        "ttft_s",
        "usage",
    )

    def __init__(self, arrival_s: float, ts: float, table: RoutingTable | None) -> None:
        super().__init__()  # decision, prediction, lease, sent_s, head_s, client_gone
        self.arrival_s = arrival_s
        self.ts = ts
        self.table = table
        self.request_id = ""
        self.parsed: ParsedRequest | None = None
        self.prompt_tokens_est = 0
        self.prefix_hashes: list[int] | None = None  # the prompt's chunk hashes, when the index made them
        self.routing_s = 0.0
        self.ttft_s: float | None = None
        self.status = 0
        self.stream = False
        self.bytes_out = 0
        self.error: str | None = None
        self.usage: Usage | None = None
        self.finished = False  # the last byte is on its way: a disconnect now is not the client leaving
        self.response_started = False
        self.key: ClientKeySpec | None = None
        self.refused_key: ClientKeySpec | None = None  # a known key the front door refused (401)
        self.grant: Grant | None = None  # what the front door granted the key
        self.span: Any = None  # the OpenTelemetry span, only while tracing is on
        self.canary_id: int | None = None  # a canary runs (issue 23): its experiment
        self.arm: Literal["live", "canary"] | None = None  # ... and which side serves this request
        self.shadow: ShadowOutcome | None = None  # what a running shadow would have done
