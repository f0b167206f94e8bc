"""The user attributes spectune keeps on Optuna trials: their names, and `TrialRecord`, the one
typed view that reads them (so no reader indexes a trial's attributes by string).

Writers: the lease service (api/services/leasing/), the study setup and the `auto` sampler.
Readers: the API's documents, the samplers, pruning, confirmation, convergence and the answer,
all through `TrialRecord`.  Values are JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Final

from optuna.trial import FrozenTrial, TrialState

from optimizer.space import SpecConfig

# Where the measurement came from.
WORKER_ID: Final = "worker_id"
LEASE_ID: Final = "lease_id"
ATTEMPT: Final = "attempt"
CONFIG: Final = "config"  # the SpecConfig as JSON
CONFIG_KEY: Final = "config_key"
SGLANG_VERSION: Final = "sglang_version"
EFFECTIVE: Final = "effective"  # settings read back from /server_info
STARTUP_S: Final = "startup_s"

# What was measured.
LEVELS: Final = "levels"  # LevelMetrics per concurrency, as reported
BASELINE_LEVELS: Final = "baseline_levels"
BASELINE_TOK_S: Final = "baseline_tok_s"
SPEEDUP_BY_LEVEL: Final = "speedup_by_level"
PARTIAL_SPEEDUP_BY_LEVEL: Final = "partial_speedup_by_level"  # a pruned trial's levels
PROGRESS_SPEEDUP_BY_LEVEL: Final = "progress_speedup_by_level"  # while it runs
PRUNED: Final = "pruned"  # {"after_concurrency", "reason"}
# Levels an interrupted trial measured before it was given up (its attempts' reports).
LEVELS_MEASURED: Final = "levels_measured"

# How it ended, when not with a measurement.
FAILURE_KIND: Final = "failure_kind"
FAILURE_MESSAGE: Final = "failure_message"
LOG_TAIL: Final = "log_tail"
# Answered without a launch: from an earlier trial of the same configuration, or inferred to fail.
DUPLICATE_OF: Final = "duplicate_of"
INFERRED_FROM: Final = "inferred_from"

# Stored values that fail today's checks, left out by api/services/trial_records.screened (why, one each).
RECORD_PROBLEMS: Final = "record_problems"

# How it was proposed: warm_start | prior_study | grid (enqueued), and what the `auto` sampler predicted.
SOURCE: Final = "source"
MODEL_PREDICTION: Final = "model_prediction"
# Why the `auto` sampler proposed a configuration its own model predicts to lose by more than
# optimizer.model_sampler.LOSE_BY to the best measured (words; absent on every other proposal).
PROPOSAL_PURPOSE: Final = "proposal_purpose"
# Set only on the copies optimizer.believer makes of launches in flight (never stored): the model's
# own prediction standing in for a result.
BELIEVED: Final = "believed"

Json = Any  # a value as Optuna stored it (JSON)
LevelDoc = Mapping[str, Any]  # spectune_protocol.LevelMetrics as JSON


@dataclass(frozen=True)
class TrialRecord:
    """A typed view of one Optuna trial and spectune's attributes on it (read-only, no copies)."""

    trial: FrozenTrial

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def state(self) -> TrialState:
        return self.trial.state

    @property
    def value(self) -> float | None:
        return self.trial.value

    @property
    def params(self) -> dict[str, Any]:
        return self.trial.params

    @property
    def constraints(self) -> dict[str, float]:
        return self.trial.constraints or {}

    @property
    def feasible(self) -> bool:
        """No constraint violated (a trial without constraints is feasible)."""
        return not any(v > 0 for v in self.constraints.values())

    def _get(self, key: str) -> Json:
        return self.trial.user_attrs.get(key)

    def _str(self, key: str) -> str | None:
        v = self._get(key)
        return None if v is None else str(v)

    def _int(self, key: str) -> int | None:
        v = self._get(key)
        return None if v is None else int(v)

    def _dict(self, key: str) -> dict[str, Json] | None:
        v = self._get(key)
        return dict(v) if isinstance(v, dict) else None

    def _levels(self, key: str) -> list[LevelDoc] | None:
        v = self._get(key)
        return [lv for lv in v if isinstance(lv, dict)] if isinstance(v, list) else None

    def _by_level(self, key: str) -> dict[str, float] | None:
        v = self._get(key)
        return {str(k): float(x) for k, x in v.items() if x is not None} if isinstance(v, dict) else None

    def has(self, key: str) -> bool:
        return key in self.trial.user_attrs

    # -- where it came from
    @property
    def has_config(self) -> bool:
        return self.has(CONFIG)

    @cached_property
    def config(self) -> SpecConfig:
        """The configuration launched; a trial without one (not yet leased) raises KeyError."""
        raw = self._get(CONFIG)
        if raw is None:
            raise KeyError(f"trial {self.number} has no configuration yet")
        return SpecConfig.model_validate(raw)

    @property
    def config_or_none(self) -> SpecConfig | None:
        return None if self._get(CONFIG) is None else self.config

    @property
    def config_key(self) -> str | None:
        return self._str(CONFIG_KEY)

    @property
    def worker_id(self) -> str | None:
        return self._str(WORKER_ID)

    @property
    def lease_id(self) -> str | None:
        """The lease whose report this trial's value is (its token says who measured it)."""
        return self._str(LEASE_ID)

    @property
    def sglang_version(self) -> str | None:
        return self._str(SGLANG_VERSION)

    @property
    def effective(self) -> dict[str, Json] | None:
        return self._dict(EFFECTIVE)

    @property
    def startup_s(self) -> float | None:
        s = self._get(STARTUP_S)
        return float(s) if isinstance(s, int | float) else None

    @property
    def source(self) -> str | None:
        return self._str(SOURCE)

    @property
    def proposal_purpose(self) -> str | None:
        return self._str(PROPOSAL_PURPOSE)

    @property
    def model_prediction(self) -> dict[str, Json] | None:
        return self._dict(MODEL_PREDICTION)

    # -- what it measured
    @property
    def levels(self) -> list[LevelDoc]:
        return self._levels(LEVELS) or []

    @property
    def has_levels(self) -> bool:
        return bool(self._get(LEVELS))

    @property
    def baseline_levels(self) -> list[LevelDoc]:
        return self._levels(BASELINE_LEVELS) or []

    @property
    def baseline_tok_s(self) -> dict[int, float]:
        return {int(k): v for k, v in (self._by_level(BASELINE_TOK_S) or {}).items()}

    @property
    def speedup_by_level(self) -> dict[str, float] | None:
        return self._by_level(SPEEDUP_BY_LEVEL)

    def speedup_at(self, level: int) -> float | None:
        return (self.speedup_by_level or {}).get(str(level))

    @property
    def partial_speedup_by_level(self) -> dict[str, float] | None:
        return self._by_level(PARTIAL_SPEEDUP_BY_LEVEL)

    @property
    def progress_speedup_by_level(self) -> dict[int, float]:
        return {int(k): v for k, v in (self._by_level(PROGRESS_SPEEDUP_BY_LEVEL) or {}).items()}

    @property
    def pruned(self) -> dict[str, Json] | None:
        return self._dict(PRUNED)

    @property
    def levels_measured(self) -> list[LevelDoc] | None:
        return self._levels(LEVELS_MEASURED)

    # -- how it ended otherwise
    @property
    def failure_kind(self) -> str | None:
        return self._str(FAILURE_KIND)

    @property
    def failure_message(self) -> str | None:
        return self._str(FAILURE_MESSAGE)

    @property
    def duplicate_of(self) -> int | None:
        return self._int(DUPLICATE_OF)

    @property
    def inferred_from(self) -> int | None:
        return self._int(INFERRED_FROM)

    @property
    def record_problems(self) -> list[str] | None:
        v = self._get(RECORD_PROBLEMS)
        return [str(x) for x in v] if isinstance(v, list) else None

    @property
    def launched(self) -> bool:
        """Measured by a launch of its own (not answered from an earlier trial, nor inferred to fail)."""
        return not self.has(DUPLICATE_OF) and not self.has(INFERRED_FROM)


def records(trials: Iterable[FrozenTrial]) -> list[TrialRecord]:
    return [TrialRecord(t) for t in trials]


def measured_feasible(trials: Iterable[FrozenTrial], *required: str) -> list[FrozenTrial]:
    """Trials measured by a launch of their own that met every constraint, with a value and
    each of the `required` attributes set (the one filter the search, pruning, confirmation,
    convergence and the answer share).  Duplicates answered from an earlier trial are left out:
    they would count one measurement twice."""
    out = []
    for t in trials:
        r = TrialRecord(t)
        if r.state != TrialState.COMPLETE or r.value is None or r.has(DUPLICATE_OF) or not r.feasible:
            continue
        if all(t.user_attrs.get(key) for key in required):
            out.append(t)
    return out
