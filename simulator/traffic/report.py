"""Per-client-region latency percentiles of a traffic run."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from simulator.traffic.runner import RequestResult


@dataclass(frozen=True, slots=True)
class RegionSummary:
    """What clients in one region saw. TTFT percentiles cover successful streamed requests."""

    region: str
    requests: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    total_p50_ms: float | None
    cached_token_share: float | None  # cached / prompt tokens over successful requests


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks; None if empty.

    +inf values (a benchmark's requests that got no first token) sort last, and a rank next to
    one is +inf (interpolating towards infinity), never nan.
    """
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high or ordered[low] == ordered[high]:
        return ordered[low]
    if math.isinf(ordered[high]):
        return ordered[high]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(results: Iterable[RequestResult]) -> list[RegionSummary]:
    by_region: dict[str, list[RequestResult]] = {}
    for result in results:
        by_region.setdefault(result.client_region, []).append(result)
    summaries: list[RegionSummary] = []
    for region, items in sorted(by_region.items()):
        ok = [r for r in items if r.ok]
        ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
        totals = [r.total_ms for r in ok if r.total_ms is not None]
        prompt = sum(r.prompt_tokens or 0 for r in ok)
        cached = sum(r.cached_tokens or 0 for r in ok)
        summaries.append(
            RegionSummary(
                region=region,
                requests=len(items),
                errors=len(items) - len(ok),
                ttft_p50_ms=percentile(ttfts, 50),
                ttft_p90_ms=percentile(ttfts, 90),
                ttft_p99_ms=percentile(ttfts, 99),
                total_p50_ms=percentile(totals, 50),
                cached_token_share=cached / prompt if prompt else None,
            )
        )
    return summaries


def format_summary(summaries: Sequence[RegionSummary]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    rows = [("region", "requests", "errors", "ttft p50 ms", "p90", "p99", "total p50 ms", "cached")]
    for s in summaries:
        share = "-" if s.cached_token_share is None else f"{s.cached_token_share:.0%}"
        rows.append(
            (
                s.region,
                str(s.requests),
                str(s.errors),
                ms(s.ttft_p50_ms),
                ms(s.ttft_p90_ms),
                ms(s.ttft_p99_ms),
                ms(s.total_p50_ms),
                share,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.rjust(widths[i]) if i else cell.ljust(widths[i]) for i, cell in enumerate(row))
        for row in rows
    )
