"""Names of the user attributes spectune keeps on Optuna trials (one place, so they never drift).

Readers: the API's trial list, the report, the samplers and the answer.  Values are JSON.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from optuna.trial import FrozenTrial, TrialState

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


def measured_feasible(trials: Iterable[FrozenTrial], *required: str) -> list[FrozenTrial]:
    """Trials measured by a launch of their own that met every constraint, with a value and
    each of the `required` attributes set (the one filter the search, pruning, confirmation,
    convergence and the answer share).  Duplicates answered from an earlier trial are left out:
    they would count one measurement twice."""
    out = []
    for t in trials:
        if t.state != TrialState.COMPLETE or t.value is None or DUPLICATE_OF in t.user_attrs:
            continue
        if t.constraints and any(v > 0 for v in t.constraints.values()):
            continue
        if all(t.user_attrs.get(key) for key in required):
            out.append(t)
    return out
