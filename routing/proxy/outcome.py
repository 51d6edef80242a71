"""What a finished request leaves behind: its metrics, its record, and what the index learns.

The node's ``usage`` is the truth the gateway's guesses are checked against: the cached tokens it
reports tell the prefix index how good its match was (and, for precisely indexed nodes, how its
prediction compared), and its exact prompt tokens correct the characters-per-token estimate. The
request record (``RequestRecord``, the contract's) is queued for the Redis stream the workers
aggregate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from routing.algorithms.gorgo import DECODE_SLOWDOWN_AT_FULL_BATCH
from routing.cache.approx_index import chunk_hashes
from routing.cache.prompt import PrefixIndex
from routing.cache.token_ratio import CharsPerToken
from routing.config import GatewayConfig
from routing.contract import PREFIX_HASHES_MAX, SCHEMA_VERSION, NodeSpec, RequestRecord
from routing.http.usage import PromptTokensDetails, Usage
from routing.observability.exporter import NO_NODE, GatewayMetrics
from routing.observability.request_log import RequestLog
from routing.observability.tracing import GatewayTracing
from routing.proxy.exchange import Exchange
from routing.state.measured import MeasuredInputs

logger = logging.getLogger("routing.proxy")  # the logger name operators filter on, kept across moves
_perf_counter: Final = time.perf_counter  # a C static, compiled: no module lookup per call


class RequestOutcome:
    """Counts each finished request, feeds the index back, and queues the request's record."""

    def __init__(
        self,
        config: GatewayConfig,
        request_log: RequestLog,
        metrics: GatewayMetrics,
        cache_index: PrefixIndex,
        chars_per_token: CharsPerToken,
        tracing: GatewayTracing | None,
        measured: MeasuredInputs | None = None,
    ) -> None:
        self._measured = measured
        self._region = config.region
        self._gateway_id = config.gateway_id
        self._request_log = request_log
        self._metrics = metrics
        self._cache_index = cache_index
        # The index's optional hooks, looked up once (a getattr per request costs ~0.4 k instructions).
        self._note_served: Callable[[int, int | None, int], object] | None = getattr(
            cache_index, "note_served", None
        )
        self._record_outcome: Callable[[int, str, int, int], object] | None = getattr(
            cache_index, "record_outcome", None
        )
        self._chars_per_token = chars_per_token
        self._tracing = tracing

    def finish(self, exchange: Exchange) -> None:
        """Count the request and queue its record; never raises into the request."""
        try:
            total_s = _perf_counter() - exchange.arrival_s
            decision = exchange.decision
            node = decision.node if decision is not None else None
            self._metrics.observe_request(
                node.name if node is not None else NO_NODE, exchange.status, exchange.ttft_s, total_s
            )
            parsed = exchange.parsed
            usage = exchange.usage
            details = usage.prompt_tokens_details if usage is not None else None
            if (
                details is not None
                and usage is not None
                and decision is not None
                and decision.cost is not None
            ):
                self._observe_cache(
                    decision.cost.node_id, decision.cost.matched_tokens, exchange, usage, details
                )
            prediction = exchange.prediction
            if node is not None and exchange.status == 200:
                served = self._note_served
                if served is not None:
                    predicted = prediction[2] if prediction is not None and prediction[0] == node.id else 0
                    served(node.id, usage.prompt_tokens if usage is not None else None, predicted)
            if (
                prediction is not None
                and details is not None
                and details.cached_tokens is not None
                and node is not None
                and prediction[0] == node.id
            ):
                record = self._record_outcome
                if record is not None:
                    record(node.id, prediction[1], prediction[2], details.cached_tokens)
            head_s = exchange.head_s
            if (
                head_s is not None
                and not exchange.head_with_body  # its head to first token measured nothing
                and exchange.stream
                and exchange.status == 200
                and node is not None
                and self._measured is not None
            ):
                self._measure(exchange, node, head_s, usage, details)
            if (
                usage is not None
                and usage.prompt_tokens
                and parsed is not None
                and parsed.prompt_tokens_exact is None
                and self._chars_per_token.observe(parsed.prompt_chars, usage.prompt_tokens)
            ):
                # The index counts its chunks in tokens: it follows the estimate's ratio.
                self._cache_index.set_chars_per_token(self._chars_per_token.value)
            if exchange.span is not None:
                assert self._tracing is not None
                built = self._record(exchange, total_s)
                self._request_log.submit(built)
                self._tracing.finish(exchange.span, built, node)
            else:
                # Built after this event-loop turn, with the turn's other records: the connection
                # is free for its next request sooner (routing.observability.request_log).
                self._request_log.submit_later(_RecordLater(self, exchange, total_s))
        except Exception:
            logger.exception("could not record request %s", exchange.request_id)

    def _measure(
        self,
        exchange: Exchange,
        node: NodeSpec,
        head_s: float,
        usage: Usage | None,
        details: PromptTokensDetails | None,
    ) -> None:
        """A streamed answer's prefill time, when no queue was known ahead of it (its round trip
        was taken when its head arrived: ``Proxy.handle``)."""
        assert self._measured is not None
        cost = exchange.decision.cost if exchange.decision is not None else None
        ttft_s = exchange.ttft_s
        if (
            ttft_s is not None
            and usage is not None
            and usage.prompt_tokens is not None
            and details is not None
            and details.cached_tokens is not None
            and cost is not None
            and cost.node_id == node.id
            # no prefill known to be queued ahead: a queue term no larger than what a busy
            # batch's decode slowdown alone puts there
            and cost.queue_ms <= DECODE_SLOWDOWN_AT_FULL_BATCH * cost.prefill_ms + 1.0
        ):
            self._measured.observe_prefill(
                node,
                head_s,
                (exchange.arrival_s + ttft_s - head_s) * 1000,
                usage.prompt_tokens - details.cached_tokens,
            )

    def _record(self, exchange: Exchange, total_s: float) -> RequestRecord:
        """The request's record for the stream (built off the request path, see ``finish``)."""
        decision = exchange.decision
        node = decision.node if decision is not None else None
        table = exchange.table
        parsed = exchange.parsed
        usage = exchange.usage
        details = usage.prompt_tokens_details if usage is not None else None
        prediction = exchange.prediction
        shadow = exchange.shadow
        key = exchange.key if exchange.key is not None else exchange.refused_key
        # Positional, in RequestRecord's field order (each line names its field; a test builds a
        # record with every field distinct): msgspec matches 36 keyword names at ~2.7 us a record,
        # positional arguments cost ~0.3 us.
        return RequestRecord(
            SCHEMA_VERSION,  # schema_version
            exchange.request_id,  # request_id
            exchange.ts,  # ts
            self._region,  # gateway_region
            self._gateway_id,  # gateway_id
            parsed.model if parsed is not None else "",  # model
            exchange.status,  # status
            exchange.stream,  # stream
            node.id if node is not None else None,  # node_id
            node.region if node is not None else None,  # node_region
            table.algorithm_name if table is not None else None,  # algorithm
            table.version if table is not None else None,  # policy_version
            parsed.prompt_chars if parsed is not None else 0,  # prompt_chars
            exchange.prompt_tokens_est,  # prompt_tokens_est
            usage.prompt_tokens if usage is not None else None,  # prompt_tokens
            details.cached_tokens if details is not None else None,  # cached_tokens
            usage.completion_tokens if usage is not None else None,  # completion_tokens
            exchange.routing_s * 1e6,  # routing_us
            (exchange.sent_s - exchange.arrival_s) * 1000 if exchange.sent_s else 0.0,  # gateway_ms
            exchange.ttft_s * 1000 if exchange.ttft_s is not None else None,  # ttft_ms
            total_s * 1000,  # total_ms
            exchange.bytes_out,  # bytes_out
            exchange.error,  # error
            (  # cost: the live side's, priced by the shadow when its algorithm prices nothing
                shadow.live_cost
                if shadow is not None and shadow.live_cost is not None
                else decision.cost
                if decision is not None
                else None
            ),
            decision.runner_up if decision is not None else None,  # runner_up
            prediction[1] if prediction is not None else None,  # prefix_index_mode
            prediction[2] if prediction is not None else None,  # predicted_cached_tokens
            key.id if key is not None else None,  # key_id
            key.priority if key is not None else None,  # priority
            # prefix_hashes: what-if replay rebuilds shared prefixes from these (hashes, never the
            # text); off the decision path: the answer has been relayed by now.
            record_prefix_hashes(exchange),
            exchange.canary_id,  # canary_id
            exchange.arm,  # arm
            shadow.trial_id if shadow is not None else None,  # shadow_id
            shadow.node.id if shadow is not None and shadow.node is not None else None,  # shadow_node_id
            shadow.node.region
            if shadow is not None and shadow.node is not None
            else None,  # shadow_node_region
            # shadow_cost: left out when it is the live side's terms (RequestRecord.shadow_terms)
            shadow.cost if shadow is not None and shadow.cost is not shadow.live_cost else None,
            decision.rent_ms if decision is not None else 0.0,  # rent_ms
            decision.homed if decision is not None else False,  # homed
            (exchange.head_s - exchange.sent_s) * 1000
            if exchange.head_s is not None and exchange.sent_s
            else None,  # head_ms
        )

    def _observe_cache(
        self,
        node_id: int,
        matched_tokens: int,
        exchange: Exchange,
        usage: Usage,
        details: PromptTokensDetails,
    ) -> None:
        """Tell the prefix index how much the node really had cached versus what it predicted."""
        if not (exchange.prompt_tokens_est and usage.prompt_tokens and details.cached_tokens is not None):
            return
        self._cache_index.observe(
            node_id,
            matched_tokens / exchange.prompt_tokens_est,
            details.cached_tokens / usage.prompt_tokens,
            time.time(),
        )


class _RecordLater:
    """A request's record, to build when the request log asks (``submit_later``).

    Compiled, and called without parsing arguments: ``partial(self._record, exchange, total_s)``
    made a bound method and a partial, and its call parsed two arguments (~1 k instructions).
    """

    __slots__ = ("_exchange", "_outcome", "_total_s")

    def __init__(self, outcome: RequestOutcome, exchange: Exchange, total_s: float) -> None:
        self._outcome = outcome
        self._exchange = exchange
        self._total_s = total_s

    def __call__(self) -> RequestRecord:
        return self._outcome._record(self._exchange, self._total_s)


def record_prefix_hashes(exchange: Exchange) -> tuple[int, ...]:
    """The prompt's chunk hashes for the record: the ones the prefix index made while routing it,
    else hashed here (a policy without the index); never the text."""
    hashes = exchange.prefix_hashes
    if hashes is None:
        parsed = exchange.parsed
        if parsed is None:
            return ()
        hashes = chunk_hashes(parsed.prompt_text)
    return tuple(hashes[:PREFIX_HASHES_MAX])
