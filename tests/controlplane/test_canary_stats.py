"""The canary's always-valid intervals (mSPRT): they hold at every look, so peeking does not pay."""

from __future__ import annotations

import random

from controlplane.policies.canary_stats import ArmSums, compare, compare_regions


def _add(sums: list[float], value: float) -> None:
    sums[0] += 1
    sums[1] += value
    sums[2] += value * value


def _arm(sums: list[float]) -> ArmSums:
    n = int(sums[0])
    return ArmSums(requests=n, errors=0, ttft_count=n, ttft_sum_ms=sums[1], ttft_sumsq_ms2=sums[2])


def _peeking_false_alarms(runs: int, looks_every: int, samples: int, seed: int) -> tuple[int, int]:
    """Runs of two identical arms in which some look claimed the canary slower: (always-valid, naive)."""
    rng = random.Random(seed)
    always_valid = naive = 0
    for _ in range(runs):
        canary, rest = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
        fired_valid = fired_naive = False
        for index in range(1, samples + 1):
            _add(canary, rng.expovariate(1 / 100))  # skewed, like TTFT
            _add(rest, rng.expovariate(1 / 100))
            if index % looks_every or index < 50:
                continue
            verdict = compare(
                "r", _arm(canary), _arm(rest), margin_ms=10, margin_error_rate=1.0, min_samples=50, alpha=0.05
            )
            interval = verdict.ttft_ms
            fired_valid = fired_valid or interval.low > 0
            variance = _arm(canary).ttft_variance_ms2 / index + _arm(rest).ttft_variance_ms2 / index
            fired_naive = fired_naive or interval.estimate - 1.96 * variance**0.5 > 0  # a fixed-n interval
        always_valid += fired_valid
        naive += fired_naive
    return always_valid, naive


def test_it_rarely_claims_a_difference_between_equal_arms_however_often_it_looks() -> None:
    # 200 runs, a look every 20 samples up to 2,000 (98 looks). The fixed-n interval, checked at every
    # look, claims "slower" in far more than its 2.5 % of runs; the always-valid one stays under 5 %.
    always_valid, naive = _peeking_false_alarms(runs=200, looks_every=20, samples=2_000, seed=7)
    assert always_valid <= 10, always_valid
    assert naive > 2 * always_valid and naive > 10, (naive, always_valid)


def test_it_finds_a_clearly_worse_canary() -> None:
    rng = random.Random(3)
    canary, rest = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    for _ in range(400):
        _add(canary, rng.gauss(300, 40))
        _add(rest, rng.gauss(100, 40))
    verdict = compare(
        "r", _arm(canary), _arm(rest), margin_ms=50, margin_error_rate=0.02, min_samples=200, alpha=0.05
    )
    assert verdict.enough_samples and verdict.worse is not None and verdict.ttft_ms.low > 150


def test_it_waits_for_min_samples() -> None:
    canary = ArmSums(requests=10, ttft_count=10, ttft_sum_ms=10 * 500, ttft_sumsq_ms2=10 * 500**2 + 10)
    rest = ArmSums(requests=10, ttft_count=10, ttft_sum_ms=10 * 100, ttft_sumsq_ms2=10 * 100**2 + 10)
    verdict = compare("r", canary, rest, margin_ms=50, margin_error_rate=0.02, min_samples=11, alpha=0.05)
    assert verdict.worse is None and not verdict.enough_samples


def test_it_rolls_back_on_errors_and_ignores_client_errors() -> None:
    # The workers leave 4xx out of requests; 5xx and no-answer are errors.
    canary = ArmSums(requests=300, errors=90)
    rest = ArmSums(requests=3000, errors=30)
    verdict = compare("r", canary, rest, margin_ms=50, margin_error_rate=0.02, min_samples=200, alpha=0.05)
    assert verdict.worse is not None and verdict.worse.startswith("error rate +29.0%")


def test_it_splits_alpha_over_regions() -> None:
    arms = (ArmSums(requests=300, errors=12), ArmSums(requests=3000, errors=30))
    one = compare_regions({"a": arms}, margin_ms=50, margin_error_rate=0.02, min_samples=1, alpha=0.05)
    four = compare_regions(
        {name: arms for name in "abcd"}, margin_ms=50, margin_error_rate=0.02, min_samples=1, alpha=0.05
    )
    assert four[0].error_rate.low < one[0].error_rate.low  # wider: each region at alpha / 4


def test_a_stricter_margin_rolls_back_whenever_a_looser_one_does() -> None:
    """The mixture's scale was the margin itself: a stricter margin made the interval wider, so a
    canary 4x slower was rolled back at a 50 ms margin and not at 5 ms, and a margin of 0 made the
    interval infinite (no rollback at all)."""
    rng = random.Random(2)
    canary, rest = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    for _ in range(300):  # TTFT-like spread: exponential, means 400 and 100 ms
        _add(canary, rng.expovariate(1 / 400))
        _add(rest, rng.expovariate(1 / 100))
    verdicts = {
        margin: compare(
            "r",
            _arm(canary),
            _arm(rest),
            margin_ms=margin,
            margin_error_rate=0.02,
            min_samples=200,
            alpha=0.05,
        )
        for margin in (100, 50, 10, 5, 0)
    }
    assert all(verdict.worse is not None for verdict in verdicts.values()), {
        margin: (verdict.ttft_ms.low, verdict.ttft_ms.high) for margin, verdict in verdicts.items()
    }


def test_an_error_margin_of_zero_still_rolls_back_on_errors() -> None:
    verdict = compare(
        "r",
        ArmSums(requests=1000, errors=500),
        ArmSums(requests=1000, errors=0),
        margin_ms=50,
        margin_error_rate=0.0,
        min_samples=200,
        alpha=0.05,
    )
    assert verdict.worse is not None and verdict.error_rate is not None and verdict.error_rate.low > 0
