"""One rule for every launch a study may spend: is it worth its GPU-seconds? (issue 31 item 3)

Three decisions spend a launch on the study's posterior, and each is a `Move` here:

* the search goes on: a configuration not yet launched (`optimizer.convergence.assess`, the model
  rule);
* a runner-up is confirmed next to the leader (`optimizer.confirmation.candidates`);
* a winner whose interval straddles 1.0 is launched once more (`optimizer.conductor.confirming
  .relaunches`).

A move carries the chance that this one launch changes the answer the study would print by the
user's `min_gain` (each decision's own preposterior: `optimizer.gains.moved_sd`,
`optimizer.confirmation.clear_chance`), and its cost in GPU-seconds against the study's typical
launch (`Prices`, fitted once per decision: every launch of a study runs on hosts of the same
tensor-parallel size, so seconds against the study's own launches are GPU-seconds against them).  One rule judges
them all (`worth`): a move is worth its cost when its chance per typical launch reaches the
policy's `p_matters`; a launch predicted to take twice the GPU-seconds must be twice as likely to
matter.  The study stops searching when no configuration left is worth its launch, and finishes
when no confirmation move is.

Why this form.  With a benefit B for moving the answer by `min_gain` and a cost c per GPU-second,
a launch of cost C is worth opening while chance * B >= c * C: the Pandora's-box index of a box
whose prize is all or nothing (Weitzman 1979; "Cost-aware Stopping for Bayesian Optimization",
ICML 2026, restated in docs/search.md).  `p_matters` at the typical launch fixes B / c, the only
exchange rate the rule has, and it is the same risk the stop promised before it was priced.
An expected improvement per second (tried at stop 40, benchmarks/README.md "The cost-aware stop")
stopped later and answered worse: at a fixed chance the expected improvement grows with the
model's sd, so wide long shots kept paying.

What is not a move: the depth probe (`optimizer.stop_rules.depth_probe`) launches where the model
cannot price the launch at all (past the deepest position it measured), and the empirical rule
and the improvement-rate backstop end a search whose model is not trusted; docs/design.md "Rules"
keeps each with its case.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from optuna.trial import FrozenTrial

from optimizer import attrs as A
from optimizer import launch_cost
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec

FloatArray = NDArray[np.float64]


class Purpose(enum.StrEnum):
    SEARCH = "search"
    RUNNER_UP = "runner-up"
    RELAUNCH = "relaunch"


@dataclass(frozen=True)
class Move:
    """One launch the study could spend: what for, on which configuration, the chance that it
    moves the printed answer by `min_gain`, and its GPU-seconds against the study's typical launch."""

    purpose: Purpose
    key: str | None
    chance: float
    cost: float = 1.0

    @property
    def rate(self) -> float:
        """The chance per typical launch's GPU-seconds: what `worth` compares with `p_matters`."""
        return self.chance / max(self.cost, 1e-9)

    def describe(self) -> str:
        priced = f", {self.cost:.2f}x a typical launch" if abs(self.cost - 1.0) > 0.005 else ""
        return f"{self.purpose.value} {self.key}: chance {100 * self.chance:.0f}%{priced}"


def worth(move: Move, policy: Policy) -> bool:
    """The rule: the move's chance per typical launch's GPU-seconds reaches `policy.p_matters`."""
    return move.rate >= policy.p_matters


@dataclass(frozen=True)
class Prices:
    """What a study's launches cost, fitted once per decision (`prices`): the launch-cost fit
    (`optimizer.launch_cost`), the study's typical launch in seconds (the median of what its
    measured launches are predicted to take at their measured speedups; None before any), and
    whether the policy prices at all (`per_cost`)."""

    fit: launch_cost.LaunchCost
    typical: float | None
    on: bool = True

    def relative(
        self, configs: Sequence[SpecConfig], speedup: FloatArray, p_fail: FloatArray | None = None
    ) -> FloatArray:
        """Each configuration's predicted GPU-seconds (start-up and benchmark) against the study's
        typical launch.  All ones where the policy does not price or nothing is measured yet."""
        ones: FloatArray = np.ones(len(configs))
        if not self.on or self.typical is None or not configs:
            return ones
        fail = np.zeros(len(configs)) if p_fail is None else p_fail
        out: FloatArray = self.fit.seconds(configs, np.maximum(speedup, 0.05), fail) / self.typical
        return out

    def baseline(self) -> float:
        """A baseline launch's GPU-seconds against the study's typical launch (its start-up is the
        weights and the target's graphs, its benchmark the workload at 1.0x); 0 where the policy
        does not price, 1 before anything is measured."""
        if not self.on:
            return 0.0
        if self.typical is None:
            return 1.0
        return self.fit.baseline_s() / self.typical


def prices(spec: StudySpec, trials: Sequence[FrozenTrial], policy: Policy = DEFAULT_POLICY) -> Prices:
    """The study's `Prices` under its `policy` (the launch cost's ridge, `per_cost`)."""
    fit = launch_cost.fit(spec, trials, policy)
    measured = A.measured_feasible(trials, A.CONFIG)
    typical: float | None = None
    if measured:
        configs = [r.config for r in A.records(measured)]
        seen = np.array([max(float(t.value or 0.0), 0.05) for t in measured])
        typical = statistics.median(fit.seconds(configs, seen, np.zeros(len(configs))).tolist())
    return Prices(fit, typical if typical is not None and typical > 0 else None, policy.per_cost)
