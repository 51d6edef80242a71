"""Online tuning of gorgo's weights (GORGO v2): a (1+1) evolution strategy with the 1/5 success rule.

Pure: no Django, no Redis, no clock. ``step`` takes the tuner's state and what the last window
measured (the p95 TTFT of the requests routed with the weights that were live), and returns the
new state and the weights to publish next. ``policies/tuning.py`` (the I/O) runs it over the request log
and publishes through the policies app; docs/routing.md ("Online tuning") explains the choices.

One iteration, with ``x`` the incumbent weights (w_rtt, w_queue) and ``f(x)`` their window p95:

1. a window with ``x`` live measures ``f(x)`` (again: traffic drifts, so it is re-measured after
   every rejection), then a trial ``y = x * exp(sigma * N(0, 1))`` per weight, clipped to the
   bounds, goes live;
2. the next window measures ``f(y)``. Better (``f(y) < f(x)``): ``y`` is the incumbent, ``sigma``
   grows by ``SUCCESS_FACTOR``, and the next trial goes live at once. Not better: ``x`` goes live
   again (the revert) and ``sigma`` shrinks by ``SUCCESS_FACTOR ** -1/4``, so that at one success
   in five trials the step size holds still (Rechenberg's 1/5 rule);
3. when ``sigma`` falls under ``SIGMA_MIN`` the tuner has converged and keeps ``x`` live.

Mutations are multiplicative (log-normal): weights are positive scale factors, and "4x too high"
is as far from right as "4x too low".

**The promotion rule of the canary tuner** (``compare_arms`` then ``judge``; issue 24, item 4).
The online tuner runs each trial as a canary beside the live weights, so both arms are measured on
the same traffic at the same time. One window's p95 per arm (about 80 requests each in the
wall-clock benchmark) is noise: two arms with the *same* weights measured 17 % apart, and a rule
"the trial's p95 beat the live arm's by 2 %" promotes about half of the trials that change nothing,
so the weights walked wherever the noise took them. Now a trial is promoted only when its arm is
faster with stated confidence, over as many windows as that takes:

- the statistic is the difference of mean log TTFT (trial - live), i.e. the ratio of the arms'
  geometric means: TTFTs are skewed (a few seconds-long tails beside a 100 ms median) and a
  log-scale mean is far less noisy than a p95 of 80 samples, while a weight change that moves the
  bulk of requests moves it;
- the tuner looks at every tick, and each look could promote, so the interval must hold over all
  looks: the canary's own always-valid (mSPRT) interval (``canary_stats.always_valid_interval``,
  issue 23) on that difference, at ``PROMOTE_ALPHA``, its mixture scale ``PROMOTE_TAU``;
- **better**: the interval's upper end is below ``-log(1 / (1 - MIN_IMPROVEMENT))``: the trial is
  at least ``MIN_IMPROVEMENT`` faster with confidence ``1 - PROMOTE_ALPHA``;
- **not better**: the interval's lower end is above that line (it cannot be that much faster);
- **no difference**: ``MAX_WINDOWS_PER_TRIAL`` windows have passed without either (the budget of
  one trial);
- otherwise **undecided**: the canary keeps running and its samples accumulate.

Both "not better" and "no difference" revert to the incumbent, but they move ``sigma`` apart. The
1/5 rule shrinks the step after a failure because a step too large overshoots; a trial that showed
*no* difference failed for the opposite reason (its effect was below what the windows resolve), and
shrinking the step would make the next trial's effect smaller still, until the search "converged"
wherever it started, wrong inputs included (the wall-clock run told a prefill speed 2x off did
exactly that: eight ties, ``sigma`` 0.5 to 0.22, no promotion). So a tie grows ``sigma`` by
``NO_DIFFERENCE_FACTOR`` (up to ``SIGMA_MAX``), a clear loss shrinks it, and the search converges
only where steps big enough to show lose.

The interval assumes independent requests; requests of one session share a cache and an arm (the
canary splits by session), so the real variance is somewhat larger than the one used. The margin
and the bounded number of windows keep what that costs small; the unit tests measure the false
promotion rate on equal arms.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from controlplane.policies.canary_stats import always_valid_interval

Weights = tuple[float, float]  # (w_rtt, w_queue)
Outcome = Literal["measured", "accepted", "rejected", "converged"]
Verdict = Literal["better", "not better", "no difference", "undecided"]

SIGMA_START = 0.5  # log units: a first step of about x1.65
SIGMA_MIN = 0.06  # converged below ~6 % steps: finer than a window's p95 can tell apart
SIGMA_MAX = 1.5
SUCCESS_FACTOR = 1.5
FAILURE_FACTOR = SUCCESS_FACTOR**-0.25
# A trial that showed no difference within its budget of windows moved TTFT by less than the
# windows can resolve: a smaller step would show even less, so the step grows (module docstring).
NO_DIFFERENCE_FACTOR = 1.2
# A trial must beat the incumbent by this share to be taken: a "better" that is within noise is a
# random walk, not progress. The canary tuner asks it with confidence (``compare_arms``).
MIN_IMPROVEMENT = 0.02
PROMOTE_ALPHA = 0.05  # a trial no better is promoted with probability at most this, over all looks
# The mSPRT mixture's scale in log units: its power is highest for effects about this size (10 %).
PROMOTE_TAU = 0.1
# A trial's budget: undecided after this many windows, it is stopped (not better by enough to show).
MAX_WINDOWS_PER_TRIAL = 8


@dataclass(frozen=True, slots=True)
class Bounds:
    """The box the weights stay in (each a (low, high) pair)."""

    w_rtt: tuple[float, float] = (0.1, 10.0)
    w_queue: tuple[float, float] = (0.1, 10.0)

    def clip(self, weights: Weights) -> Weights:
        return (
            min(max(weights[0], self.w_rtt[0]), self.w_rtt[1]),
            min(max(weights[1], self.w_queue[0]), self.w_queue[1]),
        )


@dataclass(frozen=True, slots=True)
class TunerState:
    """Where the search is. ``trial`` is the weights live now when they are being tried."""

    incumbent: Weights
    incumbent_p95_ms: float | None = None
    sigma: float = SIGMA_START
    trial: Weights | None = None
    trials: int = 0
    successes: int = 0

    @property
    def live(self) -> Weights:
        return self.trial if self.trial is not None else self.incumbent

    @property
    def converged(self) -> bool:
        return self.sigma < SIGMA_MIN

    def to_json(self) -> dict[str, object]:
        return {
            "incumbent": list(self.incumbent),
            "incumbent_p95_ms": self.incumbent_p95_ms,
            "sigma": self.sigma,
            "trial": list(self.trial) if self.trial is not None else None,
            "trials": self.trials,
            "successes": self.successes,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> TunerState:
        incumbent = data["incumbent"]
        trial = data.get("trial")
        return cls(
            incumbent=(float(incumbent[0]), float(incumbent[1])),  # type: ignore[index]
            incumbent_p95_ms=data.get("incumbent_p95_ms"),  # type: ignore[arg-type]
            sigma=float(data.get("sigma", SIGMA_START)),  # type: ignore[arg-type]
            trial=(float(trial[0]), float(trial[1])) if trial else None,  # type: ignore[index]
            trials=int(data.get("trials", 0)),  # type: ignore[arg-type]
            successes=int(data.get("successes", 0)),  # type: ignore[arg-type]
        )


@dataclass(frozen=True, slots=True)
class Step:
    """What one window decided: the new state, the weights to publish (None: keep), and why."""

    state: TunerState
    publish: Weights | None
    outcome: Outcome
    note: str


def _fmt(weights: Weights) -> str:
    return f"w_rtt={weights[0]:.3g}, w_queue={weights[1]:.3g}"


def mutate(weights: Weights, sigma: float, rng: random.Random, bounds: Bounds) -> Weights:
    """A log-normal step from ``weights``, inside the bounds."""
    return bounds.clip(
        (
            weights[0] * math.exp(sigma * rng.gauss(0.0, 1.0)),
            weights[1] * math.exp(sigma * rng.gauss(0.0, 1.0)),
        )
    )


@dataclass(frozen=True, slots=True)
class ArmTest:
    """The canary's trial arm against the live arm: mean log TTFT (trial - live) and its interval."""

    verdict: Verdict
    estimate: float  # log units; negative: the trial is faster
    low: float
    high: float
    live_requests: int
    trial_requests: int
    windows: int

    def describe(self) -> str:
        """The evidence in words (the tuner's notes): geometric-mean TTFT ratio and its interval."""

        def pct(log_ratio: float) -> str:
            return f"{math.expm1(log_ratio):+.1%}"

        return (
            f"geometric-mean TTFT {pct(self.estimate)} against the live arm (always-valid "
            f"{1 - PROMOTE_ALPHA:.0%} interval {pct(self.low)}..{pct(self.high)}) over "
            f"{self.trial_requests:,} / {self.live_requests:,} requests in {self.windows} window"
            + ("s" if self.windows != 1 else "")
        )


@dataclass(frozen=True, slots=True)
class LogSums:
    """One arm's TTFTs as running sums of their logs: what ``compare_arm_sums`` needs, kept by the
    experiment figures (``experiment_figures``) so the tuner never re-reads the request log."""

    count: int = 0
    total: float = 0.0  # sum of log TTFT (ms)
    total_sq: float = 0.0

    @staticmethod
    def log_of(ttft_ms: float) -> float:
        return math.log(max(ttft_ms, 1e-3))

    @classmethod
    def of(cls, ttfts_ms: Sequence[float]) -> LogSums:
        logs = [cls.log_of(value) for value in ttfts_ms]
        return cls(len(logs), math.fsum(logs), math.fsum(v * v for v in logs))

    def mean(self) -> float:
        return self.total / self.count

    def variance(self) -> float:
        """The sample variance (n - 1); never negative from rounding."""
        return max((self.total_sq - self.total * self.total / self.count) / (self.count - 1), 0.0)


def compare_arms(
    live_ttfts_ms: Sequence[float],
    trial_ttfts_ms: Sequence[float],
    windows: int,
    *,
    max_windows: int = MAX_WINDOWS_PER_TRIAL,
    alpha: float = PROMOTE_ALPHA,
) -> ArmTest:
    """``compare_arm_sums`` over two arms' TTFTs."""
    return compare_arm_sums(
        LogSums.of(live_ttfts_ms), LogSums.of(trial_ttfts_ms), windows, max_windows=max_windows, alpha=alpha
    )


def compare_arm_sums(
    live: LogSums,
    trial: LogSums,
    windows: int,
    *,
    max_windows: int = MAX_WINDOWS_PER_TRIAL,
    alpha: float = PROMOTE_ALPHA,
) -> ArmTest:
    """Is the trial arm faster than the live arm by ``MIN_IMPROVEMENT``, with confidence (module docstring)?

    ``windows`` is how many windows the samples span; at ``max_windows`` an undecided test is "not better".
    """
    if live.count < 2 or trial.count < 2:
        raise ValueError("compare_arms needs at least two TTFTs per arm")
    estimate = trial.mean() - live.mean()
    variance = trial.variance() / trial.count + live.variance() / live.count
    interval = always_valid_interval(estimate, variance, PROMOTE_TAU, alpha)
    line = -math.log(1.0 / (1.0 - MIN_IMPROVEMENT))
    if interval.high < line:
        verdict: Verdict = "better"
    elif interval.low > line:
        verdict = "not better"
    elif windows >= max_windows:
        verdict = "no difference"
    else:
        verdict = "undecided"
    return ArmTest(verdict, estimate, interval.low, interval.high, live.count, trial.count, windows)


def p95_rule_better(incumbent_p95_ms: float, trial_p95_ms: float) -> bool:
    """One window's rule: the trial's p95 beats the incumbent's by ``MIN_IMPROVEMENT``.

    ``step`` (the sequential search, one arm per window) uses it; the canary tuner used it until
    issue 24 and followed noise with it (module docstring), so it now uses ``compare_arms``.
    """
    return trial_p95_ms < incumbent_p95_ms * (1.0 - MIN_IMPROVEMENT)


def step(
    state: TunerState, p95_ms: float, requests: int, rng: random.Random, bounds: Bounds = Bounds()
) -> Step:
    """Advance the search by one measured window (``p95_ms`` over ``requests`` of ``state.live``)."""
    evidence = f"p95 {p95_ms:,.0f} ms over {requests:,} requests"
    if state.trial is None:
        measured = replace(state, incumbent_p95_ms=p95_ms)
        if measured.converged:
            return Step(
                measured, None, "converged", f"tuner: converged at {_fmt(state.incumbent)} ({evidence})"
            )
        trial = mutate(state.incumbent, state.sigma, rng, bounds)
        return Step(
            replace(measured, trial=trial),
            trial,
            "measured",
            f"tuner: {_fmt(state.incumbent)} measured {evidence}; trying {_fmt(trial)} (step {state.sigma:.2f})",
        )
    incumbent_p95 = state.incumbent_p95_ms if state.incumbent_p95_ms is not None else math.inf
    return decide(
        state,
        p95_rule_better(incumbent_p95, p95_ms),
        f"{evidence} against {incumbent_p95:,.0f} ms",
        rng,
        bounds,
        incumbent_p95_ms=state.incumbent_p95_ms,
        trial_p95_ms=p95_ms,
    )


def judge(
    state: TunerState,
    test: ArmTest,
    rng: random.Random,
    bounds: Bounds = Bounds(),
    *,
    live_p95_ms: float | None = None,
    trial_p95_ms: float | None = None,
) -> Step:
    """Decide on ``state.trial`` from the canary's two arms (``compare_arms``, not undecided)."""
    assert test.verdict != "undecided", "judge needs a verdict; keep the canary running"
    tie = test.verdict == "no difference"
    return decide(
        state,
        test.verdict == "better",
        test.describe() + ("; no difference shown, a wider step next" if tie else ""),
        rng,
        bounds,
        incumbent_p95_ms=live_p95_ms,
        trial_p95_ms=trial_p95_ms,
        failure_factor=NO_DIFFERENCE_FACTOR if tie else FAILURE_FACTOR,
    )


def decide(
    state: TunerState,
    better: bool,
    evidence: str,
    rng: random.Random,
    bounds: Bounds = Bounds(),
    *,
    incumbent_p95_ms: float | None = None,
    trial_p95_ms: float | None = None,
    failure_factor: float = FAILURE_FACTOR,
) -> Step:
    """The (1+1)-ES's update once ``state.trial`` is judged ``better`` or not (``evidence``: why).

    Not better: ``sigma`` times ``failure_factor`` (``NO_DIFFERENCE_FACTOR`` for a tie). The p95s,
    when known, are kept in the state (the incumbent's) for the notes and the dashboard.
    """
    assert state.trial is not None, "decide needs a trial"
    trials = state.trials + 1
    if better:
        sigma = min(SIGMA_MAX, state.sigma * SUCCESS_FACTOR)
        accepted = replace(
            state,
            incumbent=state.trial,
            incumbent_p95_ms=trial_p95_ms,
            sigma=sigma,
            trial=None,
            trials=trials,
            successes=state.successes + 1,
        )
        trial = mutate(state.trial, sigma, rng, bounds)
        return Step(
            replace(accepted, trial=trial),
            trial,
            "accepted",
            f"tuner: accepted {_fmt(state.trial)}: {evidence}; trying {_fmt(trial)} (step {sigma:.2f})",
        )
    sigma = min(SIGMA_MAX, state.sigma * failure_factor)
    return Step(
        replace(state, incumbent_p95_ms=incumbent_p95_ms, sigma=sigma, trial=None, trials=trials),
        state.incumbent,
        "rejected",
        f"tuner: reverted to {_fmt(state.incumbent)}: {_fmt(state.trial)} gave {evidence} "
        f"(step now {sigma:.2f})",
    )
