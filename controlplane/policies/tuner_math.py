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
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Literal

Weights = tuple[float, float]  # (w_rtt, w_queue)
Outcome = Literal["measured", "accepted", "rejected", "converged"]

SIGMA_START = 0.5  # log units: a first step of about x1.65
SIGMA_MIN = 0.06  # converged below ~6 % steps: finer than a window's p95 can tell apart
SIGMA_MAX = 1.5
SUCCESS_FACTOR = 1.5
FAILURE_FACTOR = SUCCESS_FACTOR**-0.25
# A trial must beat the incumbent by this share to be taken: a window's p95 is noisy, and a
# "better" that is within noise is a random walk, not progress.
MIN_IMPROVEMENT = 0.02


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
    return judge(state, state.incumbent_p95_ms, p95_ms, requests, rng, bounds)


def judge(
    state: TunerState,
    incumbent_p95_ms: float | None,
    p95_ms: float,
    requests: int,
    rng: random.Random,
    bounds: Bounds = Bounds(),
) -> Step:
    """Decide on ``state.trial`` measured at ``p95_ms`` against the incumbent's ``incumbent_p95_ms``.

    ``step`` calls it with the incumbent's p95 from the window before; the online tuner's canaries
    measure both in the same window (the canary arm and the rest), so it passes both.
    """
    assert state.trial is not None, "judge needs a trial"
    evidence = f"p95 {p95_ms:,.0f} ms over {requests:,} requests"
    incumbent_p95 = incumbent_p95_ms if incumbent_p95_ms is not None else math.inf
    trials = state.trials + 1
    if p95_ms < incumbent_p95 * (1.0 - MIN_IMPROVEMENT):
        sigma = min(SIGMA_MAX, state.sigma * SUCCESS_FACTOR)
        accepted = replace(
            state,
            incumbent=state.trial,
            incumbent_p95_ms=p95_ms,
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
            f"tuner: accepted {_fmt(state.trial)}: {evidence} against {incumbent_p95:,.0f} ms; "
            f"trying {_fmt(trial)} (step {sigma:.2f})",
        )
    sigma = state.sigma * FAILURE_FACTOR
    return Step(
        replace(state, incumbent_p95_ms=incumbent_p95_ms, sigma=sigma, trial=None, trials=trials),
        state.incumbent,
        "rejected",
        f"tuner: reverted to {_fmt(state.incumbent)}: {_fmt(state.trial)} gave {evidence} against "
        f"{incumbent_p95:,.0f} ms (step now {sigma:.2f})",
    )
