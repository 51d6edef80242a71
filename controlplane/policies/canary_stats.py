"""The canary's comparison with the rest of the traffic: always-valid confidence intervals (mSPRT).

Pure: no Django, no Redis, no clock. The workers keep, per region and arm (``canary`` and ``live``),
the sums ``ArmSums`` holds; ``compare`` turns two arms into intervals on the differences
(canary - rest) of mean TTFT and of error rate, and says whether the canary is worse.

Why a mixture sequential probability ratio test (mSPRT; Johari, Koomen, Pekelis, Walsh, "Always
Valid Inference: Continuous Monitoring of A/B Tests", Operations Research 2022): the workers look at
the figures every few seconds and the rollback acts on the first look that says "worse". A fixed-n
test (a t-test's 95 % interval) checked at every look is wrong far more often than 5 %: peeking
until it says "worse" eventually rolls back a canary that is no worse. The mSPRT's likelihood ratio
against a normal mixture of alternatives (variance ``tau**2``) is a martingale under the null, so by
Ville's inequality it crosses ``1/alpha`` with probability at most ``alpha`` over *all* looks, and
inverting it gives an interval that holds at every look at once::

    theta_hat = mean_canary - mean_rest
    V = var_canary / n_canary + var_rest / n_rest
    half_width = sqrt(V * (V + tau**2) / tau**2 * (2 * ln(1/alpha) + ln((V + tau**2) / V)))

(the normal approximation of the difference of means, so it is applied only once each arm has
``min_samples``). ``tau`` is the scale of one request's figure: the arms' pooled standard deviation
(TTFT) or Bernoulli one (errors), and at least the margin. It was the margin alone, which made a
stricter margin a smaller ``tau`` and so a wider interval: at a 5 ms margin a canary 300 ms slower
with a 1 s spread was never rolled back where a 50 ms margin rolled it back, and a margin of 0 made
the interval infinite. With ``tau`` at least the spread, a smaller margin rolls back whenever a
larger one does. The canary is rolled back when,
in some region, the interval's lower end exceeds the margin (it is worse by more than the margin with
confidence ``1 - alpha``); ``alpha`` is split over the regions compared (Bonferroni), so many regions
do not multiply the false rollbacks. Error rates use the same interval with Bernoulli variances
(Agresti-Coull-style ``(errors + 1) / (n + 2)``, so an arm with no errors yet has a variance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ArmSums:
    """What the workers sum per region and arm: requests, errors, answered TTFTs and their squares.

    ``requests`` excludes client errors (4xx): they say nothing about the policy. ``errors`` are
    5xx answers and requests that got no answer.
    """

    requests: int = 0
    errors: int = 0
    ttft_count: int = 0
    ttft_sum_ms: float = 0.0
    ttft_sumsq_ms2: float = 0.0

    @classmethod
    def from_json(cls, raw: Any) -> ArmSums:
        raw = raw if isinstance(raw, dict) else {}
        return cls(
            requests=int(raw.get("requests", 0)),
            errors=int(raw.get("errors", 0)),
            ttft_count=int(raw.get("ttft_count", 0)),
            ttft_sum_ms=float(raw.get("ttft_sum_ms", 0.0)),
            ttft_sumsq_ms2=float(raw.get("ttft_sumsq_ms2", 0.0)),
        )

    @property
    def ttft_mean_ms(self) -> float | None:
        return self.ttft_sum_ms / self.ttft_count if self.ttft_count else None

    @property
    def ttft_variance_ms2(self) -> float:
        n = self.ttft_count
        if n < 2:
            return 0.0
        mean = self.ttft_sum_ms / n
        return max(0.0, (self.ttft_sumsq_ms2 - n * mean * mean) / (n - 1))

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None


@dataclass(frozen=True, slots=True)
class Interval:
    """An always-valid interval on a difference (canary - rest)."""

    estimate: float
    low: float
    high: float


def always_valid_interval(estimate: float, variance: float, tau: float, alpha: float) -> Interval:
    """The mSPRT interval on a difference whose estimate has ``variance`` (module docstring)."""
    variance = max(variance, 1e-12)  # two arms without spread: a (near) point, not a division by 0
    tau2 = max(tau, 1e-9) ** 2
    half = math.sqrt(
        variance
        * (variance + tau2)
        / tau2
        * (2 * math.log(1 / alpha) + math.log((variance + tau2) / variance))
    )
    return Interval(estimate=estimate, low=estimate - half, high=estimate + half)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One region's comparison: the intervals, whether there are enough samples, and what is worse."""

    region: str
    canary: ArmSums
    rest: ArmSums
    ttft_ms: Interval | None
    error_rate: Interval | None
    enough_samples: bool
    worse: str | None  # why the canary is worse by more than the margin; None: not shown (yet)

    def as_json(self) -> dict[str, Any]:
        """Plain values (the API, the dashboard push and the policy page show them)."""

        def arm(sums: ArmSums) -> dict[str, Any]:
            return {
                "requests": sums.requests,
                "errors": sums.errors,
                "error_rate": sums.error_rate,
                "ttft_count": sums.ttft_count,
                "ttft_mean_ms": sums.ttft_mean_ms,
            }

        def interval(value: Interval | None) -> dict[str, float] | None:
            return (
                None if value is None else {"estimate": value.estimate, "low": value.low, "high": value.high}
            )

        return {
            "region": self.region,
            "canary": arm(self.canary),
            "rest": arm(self.rest),
            "ttft_diff_ms": interval(self.ttft_ms),
            "error_rate_diff": interval(self.error_rate),
            "enough_samples": self.enough_samples,
            "worse": self.worse,
        }


def compare(
    region: str,
    canary: ArmSums,
    rest: ArmSums,
    *,
    margin_ms: float,
    margin_error_rate: float,
    min_samples: int,
    alpha: float,
) -> Verdict:
    """Compare the canary with the rest in one region at level ``alpha`` (already split by regions)."""
    ttft = None
    if canary.ttft_count >= 2 and rest.ttft_count >= 2:
        assert canary.ttft_mean_ms is not None and rest.ttft_mean_ms is not None
        pooled = (
            (canary.ttft_count - 1) * canary.ttft_variance_ms2
            + (rest.ttft_count - 1) * rest.ttft_variance_ms2
        ) / (canary.ttft_count + rest.ttft_count - 2)
        ttft = always_valid_interval(
            canary.ttft_mean_ms - rest.ttft_mean_ms,
            canary.ttft_variance_ms2 / canary.ttft_count + rest.ttft_variance_ms2 / rest.ttft_count,
            max(margin_ms, math.sqrt(pooled)),
            alpha,
        )
    errors = None
    if canary.requests and rest.requests:
        p_canary = (canary.errors + 1) / (canary.requests + 2)
        p_rest = (rest.errors + 1) / (rest.requests + 2)
        p_both = (canary.errors + rest.errors + 1) / (canary.requests + rest.requests + 2)
        errors = always_valid_interval(
            canary.errors / canary.requests - rest.errors / rest.requests,
            p_canary * (1 - p_canary) / canary.requests + p_rest * (1 - p_rest) / rest.requests,
            max(margin_error_rate, math.sqrt(p_both * (1 - p_both))),
            alpha,
        )
    enough = min(canary.requests, rest.requests) >= min_samples
    worse = None
    if (
        enough
        and ttft is not None
        and ttft.low > margin_ms
        and min(canary.ttft_count, rest.ttft_count) >= min_samples
    ):
        worse = (
            f"TTFT {ttft.estimate:+.1f} ms against the rest (always-valid interval "
            f"{ttft.low:+.1f}..{ttft.high:+.1f} ms; margin {margin_ms:g} ms)"
        )
    elif enough and errors is not None and errors.low > margin_error_rate:
        worse = (
            f"error rate {errors.estimate:+.1%} against the rest (always-valid interval "
            f"{errors.low:+.1%}..{errors.high:+.1%}; margin {margin_error_rate:.1%})"
        )
    return Verdict(region, canary, rest, ttft, errors, enough, worse)


def compare_regions(
    regions: dict[str, tuple[ArmSums, ArmSums]],
    *,
    margin_ms: float,
    margin_error_rate: float,
    min_samples: int,
    alpha: float,
) -> list[Verdict]:
    """``compare`` in every region (canary, rest), with ``alpha`` split over them (Bonferroni)."""
    split = alpha / max(1, len(regions))
    return [
        compare(
            region,
            canary,
            rest,
            margin_ms=margin_ms,
            margin_error_rate=margin_error_rate,
            min_samples=min_samples,
            alpha=split,
        )
        for region, (canary, rest) in sorted(regions.items())
    ]
