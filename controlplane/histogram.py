"""The log-bucketed TTFT histogram every request bucket keeps (per node, region, client key and experiment).

Bin i holds values in (BIN_BASE_MS * GROWTH**(i-1), BIN_BASE_MS * GROWTH**i]; keys are the bin
index as text (the histogram is stored as JSON). 5 % wide bins: quantiles within 2.5 %, and a
bucket's histogram stays a few hundred entries at most. Histograms add bin by bin, so buckets can
be merged (a batch into a bucket, buckets into a chart's step) and quantiles taken afterwards. In core:
telemetry's buckets and the policies' shadow and canary figures both keep them.
"""

from __future__ import annotations

import math

BIN_BASE_MS = 0.1
BIN_GROWTH = 1.05


def ttft_bin(ttft_ms: float) -> int:
    if ttft_ms <= BIN_BASE_MS:
        return 0
    return math.ceil(math.log(ttft_ms / BIN_BASE_MS) / math.log(BIN_GROWTH) - 1e-9)


def add_to_histogram(histogram: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """``histogram`` with the counts of ``more`` added (in place; returned for convenience)."""
    for index, count in more.items():
        histogram[index] = histogram.get(index, 0) + count
    return histogram


def histogram_quantile_ms(histogram: dict[str, int], q: float) -> float | None:
    """The q-quantile of a log-bucketed histogram (geometric middle of the bin it falls in)."""
    bins = sorted((int(index), count) for index, count in histogram.items() if count > 0)
    total = sum(count for _, count in bins)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for index, count in bins:
        seen += count
        if seen >= rank:
            upper = BIN_BASE_MS * BIN_GROWTH**index
            return round(upper / math.sqrt(BIN_GROWTH) if index > 0 else upper, 3)
    return None


# ---- signed errors (predicted vs measured TTFT) ------------------------------------------------
# The same log bins for |error|, keyed "+bin" (measured above predicted) or "-bin" (below), so
# a bucket keeps the error's distribution and its sign in one JSON object that adds bin by bin.


def error_bin(error_ms: float) -> str:
    return f"{'+' if error_ms >= 0 else '-'}{ttft_bin(abs(error_ms))}"


def abs_error_histogram(signed: dict[str, int]) -> dict[str, int]:
    """The |error| histogram (plain TTFT bins) of a signed one."""
    out: dict[str, int] = {}
    for key, count in signed.items():
        index = key[1:]
        out[index] = out.get(index, 0) + count
    return out


def signed_quantile_ms(signed: dict[str, int], q: float) -> float | None:
    """The q-quantile of a signed error histogram: most negative bins first, then positive ones."""
    negative = sorted(((int(k[1:]), c) for k, c in signed.items() if k[0] == "-" and c > 0), reverse=True)
    positive = sorted((int(k[1:]), c) for k, c in signed.items() if k[0] == "+" and c > 0)
    ordered = [(-1, index, count) for index, count in negative] + [
        (1, index, count) for index, count in positive
    ]
    total = sum(count for _, _, count in ordered)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for sign, index, count in ordered:
        seen += count
        if seen >= rank:
            upper = BIN_BASE_MS * BIN_GROWTH**index
            middle = upper / math.sqrt(BIN_GROWTH) if index > 0 else upper
            return round(sign * middle, 3)
    return None
