"""Is the answer known?  The convergence stop (spec `budget.min_gain`, on by default).

After each result the study asks its fitted model (optimizer.perf_model) two questions:

1. Could a configuration not yet launched still beat the incumbent by more than `min_gain`
   with a probability that matters (`P_MATTERS`)?  The incumbent is the best measured
   configuration, or the baseline (1.0x) when none beats it: the same rule then ends a study in
   which nothing is likely to pay ("speculation does not pay").  Each candidate's chance counts
   the model's own uncertainty (Laplace), the incumbent's measurement spread, its risk of
   running out of memory, and is widened by how badly the model explains what was measured
   (the misfit factor), so a model that is wrong about this engine keeps the study going.
2. Is the incumbent measured tightly enough to rank it: its 95% interval no wider than
   `TIGHT` either side, or a confirmation to come (which re-measures it).

Both settled -> the study moves to confirmation and finishes, with a reason in words.  Before
`MIN_MEASURED` configurations are measured the model has too little to stand on and the answer
is always "not yet".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from optuna.trial import FrozenTrial
from scipy.stats import norm

from optimizer import attrs as A
from optimizer.analysis import level_intervals
from optimizer.confirmation import objective_interval
from optimizer.model_sampler import gain_over, objective_levels, observations_of, open_pool
from optimizer.perf_model import Candidates, fit
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec

P_MATTERS = 0.1
MIN_MEASURED = 4
TIGHT = 0.03
# Floor on the incumbent's log-sd when it has no spread of its own (one pass).
_INCUMBENT_FLOOR = 0.01


@dataclass(frozen=True)
class Assessment:
    settled: bool
    reason: str
    measured: int
    open_configs: int
    best_chance: float  # the largest probability that an open configuration beats the bar
    best_chance_config: str | None
    misfit: float
    pays: bool | None  # None while unsettled

    def as_json(self) -> dict[str, object]:
        return {
            "settled": self.settled,
            "reason": self.reason,
            "measured": self.measured,
            "open_configs": self.open_configs,
            "best_chance": self.best_chance,
            "best_chance_config": self.best_chance_config,
            "misfit": self.misfit,
        }


def assess(spec: StudySpec, trials: Sequence[FrozenTrial]) -> Assessment:
    measured = A.measured_feasible(trials, A.LEVELS)
    n = len({t.user_attrs.get("config_key") for t in measured})
    gain = spec.budget.min_gain

    def unsettled(reason: str, chance: float = 1.0, key: str | None = None, misfit: float = 1.0) -> Assessment:
        return Assessment(False, reason, n, -1, chance, key, misfit, None)

    if n < MIN_MEASURED:
        return unsettled(f"only {n} configurations measured; the model needs at least {MIN_MEASURED}")
    model = fit(observations_of(trials), spec.search_space.num_steps.high)
    if model is None:
        return unsettled("the engine reports no accept length; the model cannot judge what is left")
    levels, weights = objective_levels(spec)
    # Misfit: how far the measured objectives lie from the model's fit, in its own sd.
    mcfg = [SpecConfig.model_validate(t.user_attrs["config"]) for t in measured]
    mean_m, sd_m = model.predict_log_speedup(Candidates.of(mcfg), levels, weights)
    got = np.log(np.maximum([float(t.value or 0.0) for t in measured], 1e-9))
    resid = (got - mean_m) / np.sqrt(sd_m**2 + 0.01**2)
    misfit = float(max(1.0, math.sqrt(float(np.mean(resid**2)))))
    best = max(measured, key=lambda t: float(t.value or 0.0))
    best_value = float(best.value or 0.0)
    pays_now = best_value > 1.0
    bar_value = max(best_value, 1.0)
    bar = math.log(bar_value) + math.log1p(gain)
    iv = objective_interval(
        spec,
        best_value,
        level_intervals(best.user_attrs.get("levels") or [], best.user_attrs.get("baseline_levels") or []),
    )
    inc_sd = _INCUMBENT_FLOOR
    if iv is not None and iv.low > 0 and pays_now:
        inc_sd = max(inc_sd, math.log(iv.high / iv.low) / (2 * 1.96))
    op = open_pool(spec, trials)
    if op.configs:
        cand = Candidates.of(op.configs)
        if pays_now:
            # Against the incumbent as the model sees it (its fit of every measurement), so
            # what is uncertain for both alike cancels; the incumbent's own spread is added.
            diff, sd = gain_over(spec, model, op.configs, mcfg[measured.index(best)])
            z = (diff - math.log1p(gain)) / (sd * misfit)
        else:
            mean, sd = model.predict_log_speedup(cand, levels, weights)
            z = (mean - bar) / (sd * misfit)
        chance = norm.cdf(z) * (1.0 - op.p_fail)
        i = int(np.argmax(chance))
        top, top_key = float(chance[i]), op.configs[i].key
    else:
        top, top_key = 0.0, None
    label = best.user_attrs.get("config_key")
    if top >= P_MATTERS:
        return Assessment(
            False,
            f"{top_key} may still beat {bar_value:.3f}x by more than {100 * gain:.0f}% "
            f"(chance {100 * top:.0f}%, model misfit x{misfit:.1f})",
            n,
            len(op.configs),
            top,
            top_key,
            misfit,
            None,
        )
    tight = iv is None or (iv.high / iv.low) ** 0.5 - 1.0 <= TIGHT
    if pays_now and not tight and spec.confirmation.top <= 0:
        return Assessment(
            False,
            f"{label} leads but its interval is wider than ±{100 * TIGHT:.0f}% and no confirmation is set",
            n,
            len(op.configs),
            top,
            top_key,
            misfit,
            None,
        )
    left = f"none of the {len(op.configs)} configurations left" if op.configs else "no configuration is left that"
    if pays_now:
        reason = (
            f"converged after {n} configurations: {left} has a {100 * P_MATTERS:.0f}% chance to beat "
            f"{label} ({best_value:.3f}x) by more than {100 * gain:.0f}%"
        )
    else:
        reason = (
            f"speculation does not pay: after {n} configurations the best is {best_value:.3f}x and "
            f"{left} has a {100 * P_MATTERS:.0f}% chance to beat the baseline by more than {100 * gain:.0f}%"
        )
    return Assessment(True, reason, n, len(op.configs), top, top_key, misfit, pays_now)
