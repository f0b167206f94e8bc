"""What one more launch costs: predicted start-up plus benchmark time, in seconds of the host.

Start-up is mostly weight loading (the same for every configuration of a study) and CUDA-graph
capture, which grows with the draft steps (one draft decode graph per step), with topk (wider
draft graphs) and with the draft tokens (verify and draft-extend graphs); docs/sglang.md §3.
It is fitted to the start-up times the study has measured, by non-negative least squares with a
small ridge towards "all the same", so one or two measured launches already give a usable answer
and no configuration is ever predicted cheaper than loading the weights.

The benchmark time is the workload's tokens at the predicted speedup times the baseline's rate.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from optuna.trial import FrozenTrial, TrialState
from scipy.optimize import lsq_linear

from optimizer import attrs as A
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec

FloatArray = NDArray[np.float64]

N_FEATURES = 5


def _features(configs: Sequence[SpecConfig]) -> FloatArray:
    """Weights, draft decode graphs (steps, wider with topk), verify/extend graphs (draft
    tokens), and, where the study tunes the captured batch, the graphs per size that it adds
    (more sizes, each with a draft graph per step)."""
    rows = []
    for cfg in configs:
        c = cfg.canonical()
        bs = float(c.cuda_graph_max_bs or 0)
        rows.append(
            [
                1.0,
                float(c.num_steps),
                float(c.num_steps * (c.topk - 1)),
                float(c.num_draft_tokens),
                bs * (1 + c.num_steps),
            ]
        )
    return np.array(rows, dtype=float).reshape(len(rows), N_FEATURES)


@dataclass(frozen=True)
class LaunchCost:
    weights: FloatArray | None  # None: no start-up measured yet (every launch costs the same)
    bench_s_at_1x: float  # benchmark seconds of the whole workload at speedup 1.0 (0 if unknown)

    def startup_s(self, configs: Sequence[SpecConfig]) -> FloatArray:
        if self.weights is None:
            return np.ones(len(configs))
        out: FloatArray = np.maximum(_features(configs) @ self.weights, 1.0)
        return out

    def baseline_s(self) -> float:
        """Host seconds of a baseline launch: loading the weights (the fit's constant term, what
        every configuration's start-up shares) and the workload at 1.0x."""
        load = 1.0 if self.weights is None else max(float(self.weights[0]), 1.0)
        return load + self.bench_s_at_1x

    def seconds(self, configs: Sequence[SpecConfig], speedup: FloatArray, p_fail: FloatArray) -> FloatArray:
        """Expected host seconds of launching each configuration: a failed launch costs its start-up."""
        bench = self.bench_s_at_1x / np.maximum(speedup, 0.05)
        out: FloatArray = self.startup_s(configs) + (1.0 - p_fail) * bench
        return out


def fit(spec: StudySpec, trials: Sequence[FrozenTrial], policy: Policy = DEFAULT_POLICY) -> LaunchCost:
    configs: list[SpecConfig] = []
    secs: list[float] = []
    base_tok_s: dict[int, float] = {}
    for r in A.records(trials):
        if r.state not in (TrialState.COMPLETE, TrialState.PRUNED) or not r.has_config:
            continue
        for b in r.baseline_levels:
            if b.get("output_tok_s"):
                base_tok_s.setdefault(int(b["concurrency"]), float(b["output_tok_s"]))
        for c, v in r.baseline_tok_s.items():
            base_tok_s.setdefault(c, v)
        s = r.startup_s
        if s is not None and s > 0 and not r.has(A.DUPLICATE_OF):
            configs.append(r.config)
            secs.append(s)
    wl = spec.workload
    tokens = wl.num_prompts * wl.output_len * wl.repeats
    bench = sum(tokens / base_tok_s[c] for c in wl.concurrency if base_tok_s.get(c))
    if not secs:
        return LaunchCost(None, bench)
    med = statistics.median(secs)
    # Ridge rows towards (median, 0, 0, 0), each weighted like a fraction of one launch at a
    # typical size of its feature (the fraction: the policy's `ridge`).
    r = np.sqrt(policy.ridge) * np.array([1.0, 5.0, 5.0, 10.0, 100.0])
    a = np.vstack([_features(configs), np.diag(r)])
    target = np.concatenate([np.array(secs), r * np.array([med, 0.0, 0.0, 0.0, 0.0])])
    res = lsq_linear(a, target, bounds=(np.zeros(N_FEATURES), np.full(N_FEATURES, np.inf)))
    return LaunchCost(np.asarray(res.x, dtype=float), bench)
