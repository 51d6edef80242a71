"""What this gateway measured of each node from its own requests: the round trip and the prefill speed.

gorgo's cost model weighs a round trip (telemetry's probes, from this gateway's region) and each
node's prefill speed (the operator's ``Node.prefill_tokens_per_s``). Both can be wrong: a probe
that measures another path than the gateway's requests take, a GPU that is slower than its data
sheet, a model update. Told a prefill speed 2x off, or RTTs 30 % off, gorgo ranks nodes as if its
weights were off by the same factor (docs/routing.md, "Wrong inputs"), and searching the weights
online (the tuner) takes hours to resolve what this module measures in seconds. So the gateway
measures both from the answers it relays, and gorgo uses the measurement once there is enough of
it (``GorgoParams.measured_inputs``):

- **Round trip.** vLLM sends a stream's response head when it has accepted the request, before
  the first token (checked against a real vLLM: tests/e2e/test_gateway_real_vllm.py); the time
  from sending the request to that head is one round trip plus the node's intake (parsing, chat
  template, tokenization), both part of the TTFT this node will give. Per node, the
  ``RTT_QUANTILE`` of the last ``RTT_SAMPLES`` streamed answers (a low quantile: a busy API server
  only adds to a sample). A gateway sends few requests to most nodes abroad, so the nodes it has
  not measured yet take the table's RTT times what the measured ones say of the table: the median
  of measured / told over the nodes at least ``RATIO_MIN_RTT_MS`` away, once ``RATIO_MIN_NODES``
  of them agree within ``RATIO_AGREEMENT`` (a probe that is off is usually off for every path it
  measures: it sits elsewhere than the gateway, or times something else).
- **Prefill speed.** From the head to the first token a stream spends its queue and its prefill
  at the node (not when the head came in one read with the first event: a busy API server held
  it back, and the span measures nothing). Only answers for which this gateway knew of no prefill queued ahead count (the
  decision's ``queue_ms`` no larger than a busy batch's decode slowdown alone puts there:
  ``routing.proxy.outcome``), and of those the uncached prompt tokens the node reported
  (``usage.prompt_tokens - cached_tokens``). A least-squares line ``ms = step + ms_per_token x
  uncached`` over the last ``SPEED_SAMPLES`` of them, refitted without the samples far above it (a
  queue the gateway did not know of, another gateway's request ahead, only makes a sample slower),
  gives the node's milliseconds per prefill token once its samples span ``SPEED_MIN_SPAN_TOKENS``.
  The nodes not measured yet take their configured speed times what the measured ones say of the
  configuration, on the same terms as the round trips (an operator's figures that are off are
  usually off for every node of a kind: a data sheet's number, a model that got bigger).

A node's first estimate is made as soon as it has samples enough; after that estimates are
recomputed at most once per ``REFIT_S`` per node (the request path only appends a sample), and a
node whose measurement is older than ``STALE_S`` falls back to what it was told.
No I/O; times come from the caller.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Final

from routing.contract import NodeSpec

RTT_SAMPLES: Final = 32
RTT_MIN_SAMPLES: Final = 4
RTT_QUANTILE: Final = 0.25
SPEED_SAMPLES: Final = 64
SPEED_MIN_SAMPLES: Final = 8
SPEED_MIN_SPAN_TOKENS: Final = 512
# A sample more than this many median absolute residuals above the first fit is dropped.
OUTLIER_MADS: Final = 3.0
REFIT_S: Final = 1.0
STALE_S: Final = 300.0
EXPIRE_EVERY_S: Final = 10.0
# A fitted speed outside this factor of what the node was told is not believed (a broken fit).
SPEED_BELIEF_FACTOR: Final = 20.0
# The table's error, inferred for the nodes not measured yet (see the module's docstring).
RATIO_MIN_RTT_MS: Final = 20.0
RATIO_MIN_NODES: Final = 2
RATIO_AGREEMENT: Final = 0.2


class _Node:
    __slots__ = (
        "head_at_s",
        "head_ms",
        "ms_per_token",
        "rtt_ms",
        "sample_at_s",
        "samples",
        "seen_s",
        "unfitted",
    )

    def __init__(self) -> None:
        self.head_ms: deque[float] = deque(maxlen=RTT_SAMPLES)
        self.samples: deque[tuple[float, float]] = deque(maxlen=SPEED_SAMPLES)  # (uncached, ms)
        self.rtt_ms: float | None = None
        self.ms_per_token: float | None = None
        self.seen_s = 0.0  # when the last estimate was made
        self.unfitted = 0  # samples since then
        # When the last head and the last prefill sample came: each estimate goes stale on its own
        # clock (a busy node goes on answering heads while none of its answers is a clean sample).
        self.head_at_s = 0.0
        self.sample_at_s = 0.0


class MeasuredInputs:
    """Per node: the round trip and milliseconds per prefill token this gateway measured."""

    __slots__ = (
        "_expired_at_s",
        "_merged",
        "_merged_told",
        "_merged_version",
        "_nodes",
        "_speed_version",
        "_speeds_built",
        "_speeds_for",
        "_speeds_nodes",
        "_told",
        "_version",
        "rtt_ms",
        "speeds",
    )

    def __init__(self) -> None:
        self._nodes: dict[int, _Node] = {}
        self._expired_at_s = 0.0
        # node id -> measured round trip (ms) / milliseconds per prefill token: what gorgo reads
        self.rtt_ms: dict[int, float] = {}
        self.speeds: dict[int, float] = {}
        self._version = 0  # moves whenever rtt_ms does
        # The last views and what they were built from: the very objects, held (an id() alone
        # could name a newer object at a freed one's address, which then got the old view)
        self._merged: dict[int, float] = {}
        self._merged_told: Mapping[int, float] | None = None
        self._merged_version = -1
        self._told: dict[int, float] = {}  # node id -> the ms per token it was told (measured nodes)
        self._speed_version = 0  # moves whenever speeds does
        self._speeds_for: dict[int, float] = {}
        self._speeds_nodes: tuple[NodeSpec, ...] | None = None
        self._speeds_built = -1

    def observe_head(self, node: NodeSpec, now_s: float, head_ms: float) -> None:
        """A streamed answer's head arrived from ``node``, ``head_ms`` after the request left
        (called at once: a round trip is known long before the answer ends)."""
        self.observe(node.id, now_s, head_ms, None, None, _told_ms_per_token(node))

    def observe_prefill(self, node: NodeSpec, now_s: float, node_ms: float, uncached_tokens: int) -> None:
        """A streamed answer of ``node`` with no queue known ahead of it: ``node_ms`` from its
        head to its first token, ``uncached_tokens`` the prompt tokens the node computed."""
        self.observe(node.id, now_s, -1.0, node_ms, uncached_tokens, _told_ms_per_token(node))

    def observe(
        self,
        node_id: int,
        now_s: float,
        head_ms: float,
        node_ms: float | None,
        uncached_tokens: int | None,
        told_ms_per_token: float,
    ) -> None:
        """A round trip (``head_ms``; negative: none) and a prefill sample (``node_ms`` for
        ``uncached_tokens``; None: none) of ``node_id``."""
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _Node()
        if head_ms >= 0.0:
            node.head_ms.append(head_ms)
            node.head_at_s = now_s
        if node_ms is not None and uncached_tokens is not None and node_ms >= 0.0 and uncached_tokens >= 0:
            node.samples.append((float(uncached_tokens), node_ms))
            node.sample_at_s = now_s
        node.unfitted += 1
        if (
            now_s - node.seen_s >= REFIT_S
            # a first estimate as soon as there are samples enough for it (then once a period)
            or (node.rtt_ms is None and len(node.head_ms) == RTT_MIN_SAMPLES)
            or (node.ms_per_token is None and len(node.samples) >= SPEED_MIN_SAMPLES and node.unfitted >= 4)
        ):
            self._refit(node_id, node, now_s, told_ms_per_token)

    def expire(self, now_s: float) -> None:
        """Forget a round trip no head renewed for ``STALE_S`` (a node nobody sent to for a while)
        and a prefill speed no clean sample renewed for as long (a node that stayed busy: its old
        samples would otherwise be refitted for ever); looks at most once per ``EXPIRE_EVERY_S``
        (the request path calls it)."""
        if now_s - self._expired_at_s < EXPIRE_EVERY_S:
            return
        self._expired_at_s = now_s
        for node_id, node in self._nodes.items():
            changed = False
            if now_s - node.head_at_s > STALE_S and (node.rtt_ms is not None or node.head_ms):
                node.rtt_ms = None
                node.head_ms.clear()
                changed = True
            if now_s - node.sample_at_s > STALE_S and (node.ms_per_token is not None or node.samples):
                node.ms_per_token = None
                node.samples.clear()
                changed = True
            if changed:
                self._publish(node_id, node)

    def rtt_view(self, told: Mapping[int, float]) -> Mapping[int, float]:
        """``told`` (the RTT table from this gateway's region) with the measured round trips in
        place of its entries, and the others scaled by what the measured ones say of the table
        (``table_ratio``): one dict, rebuilt only when either changed."""
        if not self.rtt_ms:
            return told
        if told is not self._merged_told or self._version != self._merged_version:
            ratio = table_ratio(self.rtt_ms, told)
            merged = (
                dict(told)
                if ratio is None
                else {
                    node_id: rtt * ratio if rtt >= RATIO_MIN_RTT_MS else rtt for node_id, rtt in told.items()
                }
            )
            merged.update(self.rtt_ms)
            self._merged, self._merged_told, self._merged_version = merged, told, self._version
        return self._merged

    def speed_view(self, nodes: tuple[NodeSpec, ...]) -> dict[int, float] | None:
        """Milliseconds per prefill token for ``nodes``: the measured ones, and the others' configured
        speed scaled by what the measured ones say of the configuration (``agreed_ratio``); None
        when nothing is measured. One dict per candidate tuple, rebuilt only when either changed."""
        if not self.speeds:
            return None
        if nodes is not self._speeds_nodes or self._speed_version != self._speeds_built:
            ratio = agreed_ratio(
                [ms / self._told[node_id] for node_id, ms in self.speeds.items() if self._told.get(node_id)]
            )
            view: dict[int, float] = {}
            if ratio is not None:
                for node in nodes:
                    rate = node.prefill_tokens_per_s
                    if rate > 0:
                        view[node.id] = 1000.0 / rate * ratio
            view.update(self.speeds)
            self._speeds_for, self._speeds_nodes, self._speeds_built = view, nodes, self._speed_version
        return self._speeds_for

    def _refit(self, node_id: int, node: _Node, now_s: float, told_ms_per_token: float) -> None:
        node.seen_s = now_s
        if not node.unfitted:
            return
        node.unfitted = 0
        heads = node.head_ms
        if len(heads) >= RTT_MIN_SAMPLES:
            ordered = sorted(heads)
            node.rtt_ms = ordered[int(RTT_QUANTILE * (len(ordered) - 1))]
        if len(node.samples) >= SPEED_MIN_SAMPLES:
            slope = fit_ms_per_token(list(node.samples))
            if slope is not None and told_ms_per_token / SPEED_BELIEF_FACTOR <= slope <= (
                told_ms_per_token * SPEED_BELIEF_FACTOR
            ):
                node.ms_per_token = slope
                self._told[node_id] = told_ms_per_token
        self._publish(node_id, node)

    def _publish(self, node_id: int, node: _Node) -> None:
        if node.rtt_ms is None:
            if self.rtt_ms.pop(node_id, None) is not None:
                self._version += 1
        elif self.rtt_ms.get(node_id) != node.rtt_ms:
            self.rtt_ms[node_id] = node.rtt_ms
            self._version += 1
        if node.ms_per_token is None:
            if self.speeds.pop(node_id, None) is not None:
                self._speed_version += 1
        elif self.speeds.get(node_id) != node.ms_per_token:
            self.speeds[node_id] = node.ms_per_token
            self._speed_version += 1


def _told_ms_per_token(node: NodeSpec) -> float:
    rate = node.prefill_tokens_per_s
    return 1000.0 / rate if rate > 0 else 1.0


def table_ratio(measured: Mapping[int, float], told: Mapping[int, float]) -> float | None:
    """What the measured round trips say of the table: ``agreed_ratio`` of measured / told over the
    nodes at least ``RATIO_MIN_RTT_MS`` away (nearer, the node's intake outweighs the trip)."""
    return agreed_ratio(
        [
            rtt / told[node_id]
            for node_id, rtt in measured.items()
            if told.get(node_id, 0.0) >= RATIO_MIN_RTT_MS
        ]
    )


def agreed_ratio(ratios: list[float]) -> float | None:
    """The median of measured / told ratios once ``RATIO_MIN_NODES`` of them agree within
    ``RATIO_AGREEMENT`` of it; else None (too few, or the nodes differ: each keeps its own)."""
    if len(ratios) < RATIO_MIN_NODES:
        return None
    ratios = sorted(ratios)
    median = ratios[len(ratios) // 2]
    if ratios[0] < median * (1 - RATIO_AGREEMENT) or ratios[-1] > median * (1 + RATIO_AGREEMENT):
        return None
    return median


def fit_ms_per_token(samples: list[tuple[float, float]]) -> float | None:
    """The slope of ``ms = step + slope x tokens`` over (tokens, ms) samples, refitted without the
    ones far above the first line; None when the tokens do not span ``SPEED_MIN_SPAN_TOKENS``."""
    line = _least_squares(samples)
    if line is None:
        return None
    step, slope = line
    residuals = [ms - (step + slope * tokens) for tokens, ms in samples]
    spread = sorted(abs(r) for r in residuals)[len(residuals) // 2]
    kept = [sample for sample, r in zip(samples, residuals, strict=True) if r <= OUTLIER_MADS * spread + 1.0]
    if len(kept) >= SPEED_MIN_SAMPLES and len(kept) < len(samples):
        line = _least_squares(kept) or line
    slope = line[1]
    return slope if slope > 0.0 else None


def _least_squares(samples: list[tuple[float, float]]) -> tuple[float, float] | None:
    count = len(samples)
    low = min(tokens for tokens, _ in samples)
    high = max(tokens for tokens, _ in samples)
    if high - low < SPEED_MIN_SPAN_TOKENS:
        return None
    mean_tokens = sum(tokens for tokens, _ in samples) / count
    mean_ms = sum(ms for _, ms in samples) / count
    covariance = sum((tokens - mean_tokens) * (ms - mean_ms) for tokens, ms in samples)
    variance = sum((tokens - mean_tokens) ** 2 for tokens, _ in samples)
    if variance <= 0.0:
        return None
    slope = covariance / variance
    return mean_ms - slope * mean_tokens, slope
