"""Per-concurrency answers, and their export as SGLang's adaptive speculative config.

With several concurrency levels the best configuration usually shrinks as the batch grows
(verify cost grows with batch x draft tokens).  SGLang 0.5.23 can follow that at run time with
`--speculative-adaptive --speculative-adaptive-config FILE`: a JSON object whose integer-string
keys are batch sizes, each with `candidate_steps` (non-negative integers, 0 = no drafting); a
running batch is padded to its CUDA-graph size and served by the largest key not above it (the
smallest key below all of them).  Its rules, from `speculative/adaptive_spec_params.py` and
`arg_groups/speculative_hook.py` (docs/sglang.md §2 rule 10):

* chains only: adaptive mode needs topk = 1 and sets draft tokens to steps + 1;
* every key's `candidate_steps` is a non-empty list of integers >= 0;
* `--speculative-num-steps` must be one of the union of all candidate steps;
* it is silently ignored (static settings) where unsupported (e.g. attention DP).

We pin each level's slot to the steps measured best there (one candidate per key), so the
server runs what was measured.  When a level's winner is a tree, the export uses the best chain
measured at that level instead and says what that costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

from optimizer import attrs as A
from optimizer.analysis import Interval
from optimizer.objective import objective_intervals
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec

ADAPTIVE_FILE = "spectune_adaptive_spec.json"


@dataclass(frozen=True)
class LevelAnswer:
    concurrency: int
    trial_number: int
    config: SpecConfig
    speedup: float
    interval: Interval | None

    @property
    def pays(self) -> bool:
        """Speculation beats the baseline here beyond noise (or without a spread to judge, above 1)."""
        return self.interval.low > 1.0 if self.interval is not None else self.speedup > 1.0

    def as_json(self) -> dict[str, Any]:
        return {
            "trial_number": self.trial_number,
            "config": self.config.model_dump(mode="json"),
            "speedup": self.speedup,
            "speedup_interval": None
            if self.interval is None
            else {"low": self.interval.low, "high": self.interval.high},
            "speculation_pays": self.pays,
        }


def best_by_level(
    spec: StudySpec, trials: Sequence[FrozenTrial], *, chains_only: bool = False, extra_var: float = 0.0
) -> dict[int, LevelAnswer]:
    """The best measured configuration at each concurrency level of the workload."""
    out: dict[int, LevelAnswer] = {}
    for r in A.records(A.measured_feasible(trials, A.CONFIG, A.SPEEDUP_BY_LEVEL)):
        config = r.config.canonical()
        if chains_only and config.topk != 1:
            continue
        ivs = objective_intervals(spec.objective, r.levels, r.baseline_levels, extra_var)
        for level in spec.workload.concurrency:
            v = r.speedup_at(level)
            if v is None:
                continue
            if level not in out or v > out[level].speedup:
                out[level] = LevelAnswer(level, r.number, config, v, ivs.get(level))
    return out


@dataclass(frozen=True)
class AdaptiveExport:
    fits: bool  # the per-level winners themselves fit SGLang's rules
    reason: str
    config: dict[str, Any] | None  # the JSON file's content
    server_args: list[str]
    speedup_by_level: dict[int, float]  # what the exported slots measured

    def as_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "reason": self.reason,
            "file_name": ADAPTIVE_FILE,
            "config": self.config,
            "server_args": self.server_args,
            "speedup_by_level": {str(k): v for k, v in self.speedup_by_level.items()},
        }


def adaptive_export(spec: StudySpec, trials: Sequence[FrozenTrial], extra_var: float = 0.0) -> AdaptiveExport | None:
    """SGLang's adaptive config from the per-level answers; None with a single level.

    `extra_var`: the study's launch noise, in the intervals that decide where speculation pays.
    """
    if len(spec.workload.concurrency) < 2:
        return None
    winners = best_by_level(spec, trials, extra_var=extra_var)
    if len(winners) < len(spec.workload.concurrency):
        return AdaptiveExport(False, "not every concurrency level has a measurement yet", None, [], {})
    trees = [a for a in winners.values() if a.pays and a.config.topk != 1]
    fits = not trees
    slots = winners
    reason = "the per-level winners are chains (topk 1): SGLang's adaptive mode can switch between them"
    if trees:
        chains = best_by_level(spec, trials, chains_only=True, extra_var=extra_var)
        missing = [c for c in spec.workload.concurrency if c not in chains]
        if missing:
            return AdaptiveExport(
                False,
                f"the winners at concurrency {', '.join(str(a.concurrency) for a in trees)} are trees (topk > 1), "
                "and SGLang's adaptive mode runs chains only; no chain was measured at "
                f"{', '.join(map(str, missing))}: use the static configuration",
                None,
                [],
                {},
            )
        slots = chains
        losses = ", ".join(f"{a.concurrency}: {a.speedup:.3f}x -> {chains[a.concurrency].speedup:.3f}x" for a in trees)
        reason = (
            "the winners at some levels are trees (topk > 1), which SGLang's adaptive mode cannot run; "
            f"this export uses the best chain measured at each level instead (speedup {losses})"
        )
    if not any(a.pays for a in slots.values()):
        return AdaptiveExport(
            False, "speculation beats the baseline at no level: run without speculation", None, [], {}
        )
    doc: dict[str, Any] = {}
    steps_by_level: dict[int, int] = {}
    for level in sorted(slots):
        a = slots[level]
        steps = a.config.num_steps if a.pays else 0
        steps_by_level[level] = steps
        doc[str(level)] = {"candidate_steps": [steps]}
    positive = [s for s in steps_by_level.values() if s > 0]
    initial = steps_by_level[min(steps_by_level)] or max(positive)
    args = [
        "--speculative-adaptive",
        "--speculative-adaptive-config", ADAPTIVE_FILE,
        "--speculative-num-steps", str(initial),
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(initial + 1),
    ]  # fmt: skip
    problems = check_adaptive_config(doc, initial_steps=initial, topk=1)
    if problems:  # pragma: no cover - the construction above follows the same rules
        raise AssertionError(f"built an adaptive config SGLang would reject: {problems}")
    measured = {level: (slots[level].speedup if steps_by_level[level] > 0 else 1.0) for level in steps_by_level}
    return AdaptiveExport(fits, reason, doc, args, measured)


def check_adaptive_config(doc: Mapping[str, Any], *, initial_steps: int, topk: int) -> list[str]:
    """What SGLang 0.5.23 would reject (or silently ignore) in this adaptive setup; [] when fine."""
    problems = []
    if topk != 1:
        problems.append(f"topk {topk}: adaptive speculative decoding supports topk 1 only")
    union: set[int] = set()
    bs_keys = [k for k in doc if isinstance(k, str) and k.isdigit()]
    if not bs_keys:
        problems.append('no integer-string batch-size key, e.g. {"1": {"candidate_steps": [3]}}')
    for key in bs_keys:
        entry = doc[key]
        steps = entry.get("candidate_steps") if isinstance(entry, Mapping) else None
        if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and s >= 0 for s in steps):
            problems.append(f"batch size {key}: candidate_steps must be a non-empty list of integers >= 0")
            continue
        union.update(steps)
    if union and initial_steps not in union:
        problems.append(f"--speculative-num-steps {initial_steps} is not one of the candidate steps {sorted(union)}")
    return problems
