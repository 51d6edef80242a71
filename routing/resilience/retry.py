"""Send a request to its chosen node; before any byte came back, retry it on another.

Retried: a refused connection, a connection dropped before the answer, (streams) no response
headers within the first-byte timeout (vLLM sends a stream's headers at once, so silence means a
hung node), a stream that ended before its first event (the node died while the request queued
or prefilled: the client has been sent nothing, its head waits for that event) or whose node,
silent past the first-byte timeout before that event, does not answer ``/health`` either, and a server-error answer (``RETRIED_STATUSES``: vLLM's 500 "The engine is dead." from
a node going down, a 502/503/504 from whatever stands in front of it), which says nothing about
the request and would otherwise reach the client while other nodes are fine (region-outage: the
requests that reached a region's nodes as they stopped). At most ``upstream_retries`` times,
not counting nodes that refused the connection (a round trip each, no wait: when a region goes
down its nodes all refuse, and one retry spent on the region's other node left the request
failed while other regions could serve it), each node once, within the retry budget
(``breaker.RetryBudget``), and never once a byte went to the client: that is the relay's side. A server error with no retry left is answered as the node gave it. Every
failure counts on the node's circuit breaker, so a node that keeps failing is kept out of the
candidates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Final

from routing.algorithms.base import Decision, RoutingRequest
from routing.cache.prompt import PrefixIndex
from routing.config import GatewayConfig
from routing.contract import NodeSpec
from routing.deadlines import FixedDelay
from routing.errors import GatewayError
from routing.http.upstream import (
    ConnectFailed,
    ConnectTimeout,
    Disconnected,
    ProtocolError,
    ReadTimeout,
    UpstreamClient,
    UpstreamResponse,
)
from routing.observability.exporter import GatewayMetrics
from routing.resilience.breaker import Breakers, RetryBudget
from routing.resilience.node_probe import HungWatch, NodeProber
from routing.state.inflight import InFlight, Lease
from routing.state.table import RoutingTable

logger = logging.getLogger("routing.proxy")  # the logger name operators filter on, kept across moves
_perf_counter: Final = time.perf_counter  # a C static, compiled: no module lookup per call

# Given the nodes still untried, choose one of them (the proxy's routing, index and all).
Reroute = Callable[[tuple[NodeSpec, ...]], Decision]
# Answers another node may well not give: the node's trouble, not the request's (501, an
# unsupported feature, would be the same everywhere).
RETRIED_STATUSES: Final = frozenset((500, 502, 503, 504))


class Attempt:
    """What the loop records on the request as it goes (the base of the proxy's ``Exchange``).

    Written before each try, so that whatever ends the request (an answer, an error, the client
    leaving) finds the node, its lease and the index's prediction of the try that counts. A class,
    not a Protocol: compiled, the loop then reads and writes these as fields, not through generic
    attribute lookups (~1.5 k instructions a request).
    """

    __slots__ = ("client_gone", "decision", "head_s", "head_with_body", "lease", "prediction", "sent_s")

    def __init__(self) -> None:
        self.decision: Decision | None = None
        self.prediction: tuple[int, str, int] | None = None  # node, index mode, predicted cached tokens
        self.lease: Lease | None = None
        self.sent_s: float | None = None
        # when the node's response head arrived (perf_counter s): a stream's head leaves the node
        # before its first token (vLLM's too), so head - sent is the round trip and the intake
        self.head_s: float | None = None
        # the head came in one read with the stream's first event (a busy API server held it back
        # until then): its head to first token measures no prefill (routing.state.measured takes
        # no such sample; its round trip, a low quantile of the heads, outlasts a late head)
        self.head_with_body = False
        self.client_gone = False


class Retrier:
    """The retry loop of one gateway, with the breakers and the budget it answers to."""

    def __init__(
        self,
        config: GatewayConfig,
        client: UpstreamClient,
        inflight: InFlight,
        metrics: GatewayMetrics,
        cache_index: PrefixIndex,
        breakers: Breakers,
        prober: NodeProber | None,
    ) -> None:
        self._config = config
        self._client = client
        self._inflight = inflight
        self._metrics = metrics
        self._cache_index = cache_index
        self._breakers = breakers
        self._prober = prober
        self.budget = RetryBudget(config.retry_budget_ratio)
        self._hung_timers = FixedDelay(config.upstream_first_byte_timeout_s)

    def _hung_watch(
        self, task: asyncio.Task[Any] | None, node_id: int, table: RoutingTable
    ) -> HungWatch | None:
        """A watch that takes the request back from a node that stopped answering even /health."""
        if self._prober is None or task is None:
            return None
        return HungWatch(
            self._prober, task, node_id, table.base_urls[node_id], self._hung_timers, self._client.loop
        )

    async def open(
        self,
        attempt: Attempt,
        table: RoutingTable,
        candidates: tuple[NodeSpec, ...],
        decision: Decision,
        request: RoutingRequest,
        stream: bool,
        path: str,
        headers: bytes,
        body: bytes,
        reroute: Reroute,
        task: asyncio.Task[Any] | None,
    ) -> UpstreamResponse:
        """The first response any tried node gave (a 5xx too), or the ``GatewayError`` to answer.

        ``task`` is the request's own task: a hung node's watch cancels it (and the loop takes the
        cancellation back). The caller has it at hand, which spares a lookup of the running loop.
        """
        tried: list[NodeSpec] = []
        refused = 0  # tries a node refused outright: they cost a round trip, not a wait
        config = self._config
        first_byte_s = config.upstream_first_byte_timeout_s if stream else None
        breakers = self._breakers
        fresh = False
        while True:
            node = decision.node
            attempt.decision = decision
            attempt.prediction = decision.prediction
            lease = attempt.lease = self._inflight.begin(node.id, _prefill_tokens(decision, request))
            attempt.sent_s = _perf_counter()
            hung_watch = self._hung_watch(task, node.id, table) if first_byte_s is None else None
            target = table.urls.get((node.id, path))
            rerouted = False  # a 5xx answer, retried: compiled, no `continue` may leave the `finally`
            try:
                if target is None:
                    raise ConnectFailed(f"node {node.name} has no usable http(s) URL")
                if first_byte_s is None:
                    response = await self._client.request(target, headers, body, fresh=fresh)
                else:
                    async with asyncio.timeout(first_byte_s):
                        response = await self._client.request(target, headers, body, fresh=fresh)
                    if response.status == 200:
                        # A stream's head leaves the node at once, its first event after the queue
                        # and the prefill: a node that dies meanwhile (an outage) has sent the
                        # client nothing yet, so the client's head waits for that event and the
                        # request is retried like a refused connection; one that hangs meanwhile
                        # (not even /health answers) is taken back as a non-streaming one is.
                        attempt.head_s = _perf_counter()
                        attempt.head_with_body = response.body_started
                        if not response.body_started:
                            hung_watch = self._hung_watch(task, node.id, table)
                            try:
                                await response.first_body()
                            except BaseException:
                                response.close()
                                raise
            except asyncio.CancelledError:
                if hung_watch is None or not hung_watch.hung or attempt.client_gone:
                    raise
                assert task is not None
                task.uncancel()  # ours: the node answers nothing, not even /health
                kind, hard = "first_byte", True
                self._metrics.timeout("first_byte")
            except ConnectTimeout:
                kind, hard = "connect", True
                self._metrics.timeout("connect")
            except ConnectFailed:
                kind, hard = "connect", True
                refused += 1
            except ReadTimeout:
                breakers.failure(node.id, time.monotonic(), hard=True)
                self._metrics.upstream_error(node.name, "timeout")
                raise GatewayError(
                    504, f"Node {node.name} did not answer in time.", node_name=node.name
                ) from None
            except TimeoutError:  # ours: no response headers within the first-byte timeout
                kind, hard = "first_byte", True
                self._metrics.timeout("first_byte")
            except Disconnected:
                kind, hard = "disconnect", False
            except ProtocolError as exc:
                breakers.failure(node.id, time.monotonic(), hard=False)
                self._metrics.upstream_error(node.name, "protocol")
                logger.warning("node %s sent an unreadable response: %s", node.name, exc)
                raise GatewayError(
                    502, f"Node {node.name} sent an invalid response.", node_name=node.name
                ) from None
            else:
                if first_byte_s is None or response.status != 200:
                    attempt.head_s = _perf_counter()  # (a stream's 200: when its head came, above)
                if response.status < 500:
                    breakers.success(node.id)
                    return response
                breakers.failure(node.id, time.monotonic(), hard=False)
                if response.status not in RETRIED_STATUSES or len(tried) - refused >= config.upstream_retries:
                    return response
                others = tuple(
                    c for c in candidates if c is not node and c not in tried and c.id not in breakers.blocked
                )
                if not others or not self.budget.spend():
                    return response
                # Nothing of it went to the client: drop its error body, another node answers.
                response.close()
                lease.release()
                attempt.lease = None
                self._metrics.upstream_error(node.name, "status")
                self._metrics.retry("status")
                logger.warning("node %s answered %s; retrying", node.name, response.status)
                tried.append(node)
                decision = reroute(others)
                fresh = False
                rerouted = True
            finally:
                if hung_watch is not None:
                    hung_watch.stop()
            if rerouted:
                continue
            breakers.failure(node.id, time.monotonic(), hard=hard)
            lease.release()
            attempt.lease = None
            self._metrics.upstream_error(node.name, "timeout" if kind == "first_byte" else kind)
            tried.append(node)
            blocked = breakers.blocked
            remaining = tuple(c for c in candidates if c not in tried and c.id not in blocked)
            # A keep-alive connection the node closed just as we reused it says nothing about the
            # node: the only candidate gets one more try on a fresh connection.
            same_node_again = kind == "disconnect" and not remaining and len(tried) == 1
            if (
                len(tried) - refused > config.upstream_retries
                or not (remaining or same_node_again)
                or not self.budget.spend()
            ):
                status = 504 if kind == "first_byte" else 502
                what = (
                    f"did not start answering within {first_byte_s:g}s"
                    if kind == "first_byte"
                    else "is unreachable"
                )
                raise GatewayError(
                    status,
                    f"Node {node.name} {what}" + (" (and so was the retry)." if len(tried) > 1 else "."),
                    node_name=node.name,
                )
            self._metrics.retry(kind)
            logger.warning("node %s failed before answering (%s); retrying", node.name, kind)
            if remaining:
                decision = reroute(remaining)
            else:
                # A keep-alive connection the node closed just as we reused it says nothing about
                # the node; the only candidate gets one more try on a fresh connection.
                fresh = True


def _prefill_tokens(decision: Decision, request: RoutingRequest) -> int:
    """Prefill the node has to do: what the algorithm found uncached, else the whole prompt."""
    cost = decision.cost
    if cost is not None and cost.node_id == decision.node.id:
        return cost.uncached_tokens
    return request.prompt_tokens_est
