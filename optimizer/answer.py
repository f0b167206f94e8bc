"""The answer: which confirmed candidate a study recommends, and the one line that says what it means.

One home for what decides the answer (issue 32 item 2), used alike by the conductor (which
candidate it re-launches, optimizer.conductor.relaunches), the study document and the report
(api.services.studies), and the search-efficiency benchmark:

* `winner`: of the confirmed candidates (`Contender`), never a trial an admin quarantined; a
  feasible one before one that violates the study's constraint; a clean one before one whose
  measurement was saturated (the host's load, not the configuration's); then `choose`;
* `choose`: the best by the study's model where it is trusted (optimizer.ranking), else by the
  confirmations and search launches, or the cheapest tied with it where that is safe;
* `Answer`, `pays`, `outcome` and `verdict`: the recommended configuration as the verdict reads it;
* `best_by_level` and `adaptive_export`: the answer per concurrency level, and its export as
  SGLang's adaptive speculative config (below).

Pure: no database, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from optuna.trial import FrozenTrial

from optimizer import attrs as A
from optimizer.analysis import Interval
from optimizer.confirmation import log_sd
from optimizer.objective import objective_intervals
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from optimizer.study_state import Outcome

# ------------------------------------------------------------------------------ the candidates


@dataclass(frozen=True)
class Contender:
    """One confirmed candidate as the answer is chosen among them: its confirmation launches
    pooled (optimizer.confirmation.pooled_result), next to its search launch."""

    trial_number: int
    config: SpecConfig
    speedup: float
    interval: Interval | None = None
    # The search's measurement of the same server (None: not known, e.g. a bare confirmation).
    search_speedup: float | None = None
    # Confirmation launches pooled into `speedup` (optimizer.conductor.relaunches adds some).
    launches: int = 1
    # How far the confirmation violates the study's constraint (<= 0: it meets it).
    violation: float = 0.0
    # Levels of its (latest) confirmation that measured the host's load, with why.
    saturated: Mapping[int, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """In words: steps/topk/draft tokens at its speedup."""
        c = self.config
        return f"{c.num_steps}/{c.topk}/{c.num_draft_tokens} at {self.speedup:.3f}x"

    @classmethod
    def of_json(cls, doc: Mapping[str, Any]) -> Contender:
        """A confirmation as a JSON document carries it (a study document's `confirmation`
        entry read back over REST, optimizer/memory_store.py's records)."""
        iv = doc.get("speedup_interval")
        speedup = float(doc["speedup"])
        search = doc.get("search_speedup")
        return cls(
            trial_number=int(doc["trial_number"]),
            config=SpecConfig.model_validate(doc["config"]),
            speedup=speedup,
            interval=None if iv is None else Interval(speedup, float(iv["low"]), float(iv["high"])),
            search_speedup=float(search) if isinstance(search, int | float) else None,
            launches=int(doc.get("launches") or 1),
            violation=float(doc.get("violation") or 0.0),
            saturated={int(k): str(v) for k, v in (doc.get("saturated") or {}).items()},
        )


def cost_key(config: SpecConfig) -> tuple[int, int, int]:
    """How much a configuration costs to run: tokens verified per step, then draft work, then depth.

    Fewer draft tokens mean less verify compute per batch and smaller graphs (docs/sglang.md
    §13); steps x topk is the draft's work per step.
    """
    return config.num_draft_tokens, config.num_steps * config.topk, config.num_steps


@dataclass(frozen=True)
class Choice:
    """The answer among confirmed candidates: the cheapest of those tied with the best."""

    winner: Contender
    best: Contender  # the highest confirmed value, or the best by the study's model
    ties: list[Contender]  # the others the winner cannot be told apart from
    ranked: bool = False  # the study's model ordered them (optimizer.ranking), not the confirmations alone
    tie_risk: float = DEFAULT_POLICY.p_matters  # the policy's risk a cheaper tie was judged by, as the note says it

    @property
    def note(self) -> str | None:
        if not self.ties:
            return None
        others = ", ".join(c.label for c in self.ties)
        if self.winner is self.best:
            cheaper = [c for c in self.ties if cost_key(c.config) < cost_key(self.best.config)]
            if cheaper:
                if self.ranked:
                    return (
                        f"ties with {others} (overlapping 95% intervals); the study's model of every launch "
                        f"ranks it first and cannot show that the cheaper {cheaper[0].label} gives up less than "
                        "min_gain, so it is the answer"
                    )
                return (
                    f"ties with {others} (overlapping 95% intervals); the cheaper {cheaper[0].label} "
                    f"may be more than min_gain behind (a {100 * self.tie_risk:.0f}% chance or more), so the best "
                    "measured is the answer"
                )
            return f"ties with {others} (overlapping 95% intervals); it is also the cheapest of them"
        return f"ties with {others} (overlapping 95% intervals): the cheapest of the tied configurations is the answer"


def behind_risk(best: Contender, other: Contender, min_gain: float) -> float:
    """The chance that `other` is truly more than `min_gain` below `best`, from their confirmed
    values and 95% intervals (normal on the log scale; 1.0 without intervals)."""
    a, b = best.interval, other.interval
    if a is None or b is None:
        return 1.0
    sd = math.hypot(log_sd(a), log_sd(b))
    d = math.log(best.speedup / other.speedup) - math.log1p(min_gain)
    if sd <= 0:
        return 1.0 if d > 0 else 0.0
    return float(0.5 * math.erfc(-d / (sd * math.sqrt(2))))


class Ranking(Protocol):
    """Which candidate is best on everything the study measured (optimizer.ranking.Ranking)."""

    def estimate(self, config: SpecConfig) -> float: ...

    def surely_within(self, config: SpecConfig, best: SpecConfig, min_gain: float, z: float = ...) -> bool: ...


def _ranking_value(c: Contender) -> float:
    """What a candidate is ranked by without the study's model: its confirmed value and, where it
    is known, its search measurement too (the geometric mean: two launches of the same server,
    each against a baseline of its own host, so the ranking is not one launch's luck)."""
    v, s = c.speedup, c.search_speedup
    return math.sqrt(v * s) if s is not None and s > 0 and v > 0 else v


def choose(
    confirmed: Sequence[Contender],
    min_gain: float = 0.01,
    ranking: Ranking | None = None,
    policy: Policy = DEFAULT_POLICY,
) -> Choice:
    """The best confirmed candidate, or the cheapest one tied with it.

    Best: by `ranking` where there is one, else by the confirmed value and, where it is known
    (`search_speedup`), the search's measurement of the same server too (`_ranking_value`): a
    runner-up's one lucky confirmation does not displace a leader measured well twice.
    Where the model ranks, two launches do not overrule it: a rule that let a candidate measured
    more than `min_gain` better on both its launches displace the model's first (`overrule_z`,
    set between two-peaks seed 12 and small-gain seed 3) changed no answer once the model ranked
    on every launch, confirmations included, and was removed (family engines 0-199, two-peaks and
    small-gain 20 seeds each, identical per study without it: benchmarks/README.md "Two mends to
    the family's judge, and rules measured (stop 42)").
    Tied: the intervals overlap (the data cannot order them); the verdict says so.  Without
    intervals nothing is tied.

    `ranking` (optimizer.ranking.of: the study's model of every launch, where it is trusted):
    which candidate is best is its call, not one confirmation launch's, and a cheaper tied one is
    preferred only when measured within `min_gain` of the best and the ranking is sure
    (`policy.risk_z`: one-sided, `p_matters`) that it gives up less than `min_gain`.  Without one, the cheapest
    tied candidate is the answer only when the chance that it is more than `min_gain` below the
    best (the study's "worth having") is under `policy.p_matters`; a cheaper one that may well be further
    behind is not given the benefit of the doubt.
    """
    if not confirmed:
        raise ValueError("nothing confirmed to choose from")

    def rank(c: Contender) -> float:
        return _ranking_value(c) if ranking is None else ranking.estimate(c.config)

    best = max(confirmed, key=lambda c: (rank(c), -c.trial_number))
    best_iv = best.interval
    tied = [
        c
        for c in confirmed
        if c is not best
        and best_iv is not None
        and (iv := c.interval) is not None
        and iv.high >= best_iv.low
        and best_iv.high >= iv.low
    ]
    close = [
        c
        for c in tied
        if (
            c.speedup >= best.speedup / (1.0 + min_gain)
            and ranking.surely_within(c.config, best.config, min_gain, policy.risk_z)
            if ranking is not None
            else behind_risk(best, c, min_gain) < policy.p_matters
        )
    ]
    winner = min([best, *close], key=lambda c: (cost_key(c.config), -c.speedup))
    return Choice(winner, best, [c for c in [best, *tied] if c is not winner], ranking is not None, policy.p_matters)


def winner(
    spec: StudySpec,
    trials: Sequence[FrozenTrial],
    confirmed: Sequence[Contender],
    ranking: Ranking | None,
    min_gain: float | None = None,
    policy: Policy = DEFAULT_POLICY,
) -> Choice | None:
    """The study's answer among its confirmed candidates, or None when none can be it.

    A trial an admin quarantined (read as FAIL, api.services.trial_records.screened) is never the
    answer, however well its confirmation measured.  Of the rest, those that meet the study's
    constraint come first, and of those the clean ones: a saturated confirmation measured the
    host.  Which of them: `choose`, with `ranking`, the study's model where it is trusted
    (optimizer.ranking.of; passed in, as optimizer.ranking depends on what depends on this module).
    `min_gain`: the tie rule's margin where it is not the study's (benchmarks/answer_quality.py).
    """
    usable = {t.number for t in trials if A.TrialRecord(t).failure_kind != "quarantined"}
    done = [c for c in confirmed if c.trial_number in usable]
    ok = [c for c in done if c.violation <= 0] or done
    ok = [c for c in ok if not c.saturated] or ok
    if not ok:
        return None
    gain = spec.budget.min_gain if min_gain is None else min_gain
    return choose(ok, gain, ranking, policy)


# ----------------------------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class Answer:
    """The recommended configuration as the verdict needs it (the study document's `winner`)."""

    speedup: float | None
    interval: Interval | None
    label: str  # "steps 3 / topk 1 / draft tokens 4 (trial 7)"
    confirmed: bool
    confirmed_on: str | None = None
    # Confirmed next to a baseline the conductor called fresh (measured for the confirmation).
    fresh_baseline: bool = True
    # Levels whose measurement was the host's load, not the configuration's: no answer then.
    saturated: Mapping[int, str] = field(default_factory=dict)
    # Confirmed candidates it cannot be told apart from, in words (`choose`).
    tie_note: str | None = None
    # Why its re-measurement is no independent confirmation (api.services.leasing.confirm).
    not_independent: str | None = None


def clears(value: float | None, interval: Interval | None) -> bool:
    """Does speculation beat the baseline: the interval above 1.0, or (without a spread) the value."""
    if value is None:
        return False
    if interval is not None:
        return interval.low > 1.0
    return value > 1.0


def pays(answer: Answer | None) -> bool:
    """Does speculation pay: the answer's interval clears 1.0 (`clears`), on levels that were not
    saturated."""
    if answer is None or answer.speedup is None or answer.saturated:
        return False
    return clears(answer.speedup, answer.interval)


def outcome(answer: Answer | None) -> Outcome:
    """The answer's kind (`verdict` in one word): no answer without a clean measurement; pays when
    the interval clears 1.0; cannot tell apart above 1.0 within noise; else does not pay."""
    if answer is None or answer.speedup is None or answer.saturated:
        return Outcome.NO_ANSWER
    if pays(answer):
        return Outcome.PAYS
    return Outcome.CANNOT_TELL_APART if answer.speedup > 1.0 else Outcome.DOES_NOT_PAY


def verdict(
    answer: Answer | None, measured: int, adaptive: str | None = None, metric: str = "output throughput"
) -> str:
    """The one-line answer.  Says "speculation does not pay here" unless the interval clears 1.

    `measured`: configurations measured.  `adaptive`: the reason of an adaptive deployment (no
    configuration pays over every level, but one pays at some): the answer then follows the load.
    `metric`: what the study is judged by (`objective.metric_words`), named in the answer's first words.

    A result resting on a saturated level is no answer: the verdict says so and why.  "Fresh" is
    said only of a confirmation whose baseline was measured for it; a re-measurement the token
    that found it made is never "confirmed" (issue 35).
    """
    if answer is None or answer.speedup is None:
        return "no result yet"
    if adaptive is not None and not pays(answer) and not answer.saturated:
        return f"speculation pays at part of the load: {adaptive}"
    text = _saturated(answer, metric) or _measured(answer, measured, metric)
    return f"{text}; {answer.tie_note}" if answer.tie_note else text


def _saturated(answer: Answer, metric: str) -> str | None:
    if not answer.saturated or answer.speedup is None:
        return None
    why = min(answer.saturated.items())[1]
    return (
        f"no answer on {metric}: {answer.label} read {answer.speedup:.3f}x, but the measurement at concurrency "
        f"{', '.join(map(str, sorted(answer.saturated)))} is saturated ({why}); that figure is the host's load, "
        "not the configuration's: measure on a host with room (fewer tenants, or a slower simulated engine)"
    )


def _measured(answer: Answer, measured: int, metric: str) -> str:
    value, interval, label = answer.speedup, answer.interval, answer.label
    assert value is not None
    where = f" on {answer.confirmed_on}" if answer.confirmed_on else ""
    band = "" if interval is None else f" (95% interval {interval.low:.3f}-{interval.high:.3f})"
    if answer.not_independent is not None:
        # Never "confirmed": no second token vouches for it (issue 35).
        how = f"{answer.not_independent}; no second worker token vouches for it"
    elif answer.confirmed and answer.fresh_baseline:
        how = f"confirmed against a fresh baseline{where}"
    elif answer.confirmed:
        how = f"re-measured{where} against that host's latest baseline, which was not measured for it"
    else:
        how = "measured once in the search, not yet confirmed against a fresh baseline"
    if clears(value, interval) and interval is not None:
        return f"speculation pays on {metric}: {label} runs at {value:.3f}x the baseline{band}, {how}"
    if clears(value, interval):
        return f"speculation pays on {metric}: {label} runs at {value:.3f}x the baseline ({how}; no spread to bound it)"
    if value > 1.0:
        evidence = f"its {value:.3f}x{band} does not clear 1.0 beyond noise"
    else:
        evidence = f"it reaches only {value:.3f}x the baseline{band}"
    return (
        f"speculation does not pay here on {metric}: the best of {measured} configurations measured is {label}, "
        f"and {evidence} ({how}); run without speculation"
    )


# ---------------------------------------------------------------- per level, and the adaptive export
#
# Per-concurrency answers, and their export as SGLang's adaptive speculative config.
#
# With several concurrency levels the best configuration usually shrinks as the batch grows
# (verify cost grows with batch x draft tokens).  SGLang 0.5.23 can follow that at run time with
# `--speculative-adaptive --speculative-adaptive-config FILE`: a JSON object whose integer-string
# keys are batch sizes, each with `candidate_steps` (non-negative integers, 0 = no drafting); a
# running batch is padded to its CUDA-graph size and served by the largest key not above it (the
# smallest key below all of them).  Its rules, from `speculative/adaptive_spec_params.py` and
# `arg_groups/speculative_hook.py` (docs/sglang.md §2 rule 10):
#
# * chains only: adaptive mode needs topk = 1 and sets draft tokens to steps + 1;
# * every key's `candidate_steps` is a non-empty list of integers >= 0;
# * `--speculative-num-steps` must be one of the union of all candidate steps;
# * it is silently ignored (static settings) where unsupported (e.g. attention DP).
#
# We pin each level's slot to the steps measured best there (one candidate per key), so the
# server runs what was measured.  When a level's winner is a tree, the export uses the best chain
# measured at that level instead and says what that costs.

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
