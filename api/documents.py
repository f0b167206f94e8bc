"""The documents the study routes answer with, typed (OpenAPI shows each field).

`GET /v1/studies/{name}` is a `StudyDocument`, `GET .../trials` a list of `TrialRow`; the CLI,
the report and the dashboard notes read them through these models instead of indexing dicts by
string.  The JSON is what the routes always sent; the models only name it.

A worker-only install has no `api/` but needs none of this: every reader of these documents
(CLI client, report, dashboard) runs where the server extra is installed.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from optimizer.deploy import Mode
from optimizer.model_sampler import Move
from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from optimizer.study_state import Outcome
from spectune_protocol import LevelMetrics, VerifyProbe

StudyState = Literal["running", "stopped", "finished"]


def _utc(value: datetime) -> datetime:
    # The database and Optuna keep naive UTC timestamps (docs/optuna.md §1); the API says so.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


# A timestamp in UTC, sent with its offset (RFC 3339 date-time, as the schema states).
UtcDatetime = Annotated[datetime, AfterValidator(_utc)]
# What SGLang's /server_info reported for the fields the worker reads back (workers/launcher/server_info.py).
EffectiveValue = str | int | float | bool | list[str | int | float | bool | None] | None


class _Document(BaseModel):
    # Built by the service field by field: a key it does not know is a bug, not a silent drop.
    model_config = ConfigDict(extra="forbid")


class Interval(_Document):
    low: float
    high: float


class MeasuredLevel(LevelMetrics):
    """One concurrency level as a worker reported it (stored with the trial)."""

    # Read back from storage: a key an older or newer version wrote is not an error here.
    model_config = ConfigDict(extra="ignore")


class TrialCounts(_Document):
    """Trials of the study by Optuna state."""

    RUNNING: int = 0
    COMPLETE: int = 0
    PRUNED: int = 0
    FAIL: int = 0
    WAITING: int = 0


class StudySummary(_Document):
    """One row of `GET /v1/studies`."""

    name: str
    state: StudyState
    created_at: UtcDatetime
    model: str | None
    trials: TrialCounts


class HostBaseline(_Document):
    """A host's latest baseline of this study's server and workload: output tok/s per level."""

    worker_id: str
    measured_at: UtcDatetime
    tok_s: dict[str, float]
    verify_probe: VerifyProbe | None = Field(
        default=None, description="the target's forward timed over verify-sized token counts on this baseline's server"
    )


class BestTrial(_Document):
    """The best measured trial, and its configuration deployed for the study's serving envelope."""

    trial_number: int
    params: dict[str, int | float | str]
    config: SpecConfig
    speedup: float | None
    speedup_by_level: dict[str, float] | None
    speedup_interval_by_level: dict[str, Interval]
    levels: list[MeasuredLevel] | None
    worker_id: str | None
    sglang_version: str
    launch_command: str | None = Field(
        description="the answer's: the study's deployment command (see `deployment`); None for the search's "
        "best_measured and where no command is printed (the verdict says why)"
    )


class Tie(_Document):
    """A confirmed candidate the winner cannot be told apart from (overlapping intervals)."""

    trial_number: int
    config: SpecConfig | None
    speedup: float | None


class Winner(BestTrial):
    """The recommended configuration: the best confirmed one, else the best measured one."""

    search_speedup: float | None
    speedup_interval: Interval | None
    confirmed: bool
    confirmed_on: str | None
    # Why its re-measurement is no confirmation (the token or host that found it measured it again:
    # one token serves the study), or None (issue 35).
    not_independent: str | None = None
    # A confirmed winner is one record of the launch its numbers come from (worker_id and levels are that launch's).
    search_worker_id: str | None = Field(default=None, description="the host the search measured it on")
    lease_id: str | None = Field(default=None, description="the confirmation lease the numbers come from")
    baseline_levels: list[MeasuredLevel] | None = None
    server: ServerSettings | None = Field(default=None, description="the server that confirmation started")
    envelope_note: str = ""
    saturated: dict[str, str] = Field(description="levels whose measurement saturated the host, with why")
    ties: list[Tie] = Field(default_factory=list, description="confirmed candidates tied with the winner")
    tie_note: str | None = None
    confirmation_launches: int = Field(
        default=1, description="confirmation launches its speedup and interval pool (each against its own baseline)"
    )
    adaptive: bool = Field(
        default=False,
        description="the answer is SGLang's adaptive server its own launch proved: every number here is that "
        "launch's; `config` is its speculative settings, `trial_number` the trial that measured them statically",
    )
    steps_by_batch: dict[str, int] | None = Field(default=None, description="the adaptive server's steps by batch size")

    def label(self) -> str:
        """The answer in words: the adaptive server, or the configuration and its trial."""
        c = self.config
        if self.adaptive:
            steps = ", ".join(
                f"{bs}: {s}" for bs, s in sorted((self.steps_by_batch or {}).items(), key=lambda kv: int(kv[0]))
            )
            return (
                f"SGLang's adaptive server (steps by batch size {steps}; topk {c.topk}, "
                f"draft tokens {c.num_draft_tokens})"
            )
        return f"trial {self.trial_number}: steps {c.num_steps}, topk {c.topk}, draft tokens {c.num_draft_tokens}"


class Confirmation(_Document):
    """A candidate's re-measurement against a fresh baseline (its latest attempt), or the launch of
    the adaptive answer (`adaptive`, no trial number: it runs several trials' chains)."""

    trial_number: int | None
    config: SpecConfig | None
    state: str
    attempt: int
    worker_id: str | None
    search_speedup: float | None
    speedup: float | None
    speedup_interval: Interval | None
    speedup_by_level: dict[str, float] | None
    speedup_interval_by_level: dict[str, Interval] | None
    violation: float | None
    baseline_measured_at: str | None
    lease_id: str
    server: ServerSettings | None = Field(description="the server this confirmation started")
    envelope_note: str
    levels: list[MeasuredLevel] | None
    baseline_levels: list[MeasuredLevel] | None
    extra_passes: int
    saturated: dict[str, str] = Field(description="levels whose measurement saturated the host, with why")
    adaptive: bool = Field(default=False, description="the launch of the adaptive answer exactly as printed")
    not_independent: str | None = Field(
        default=None,
        description="why this launch does not confirm its candidate independently (the worker token or host that "
        "found it measured it again, or its baseline came from another token), or null when it does",
    )
    launches: int = Field(
        default=1,
        description="completed confirmation launches pooled in its speedup and interval (the conductor orders "
        "another when the answer straddles its decision on launch noise); the lease and levels are the latest's",
    )


class LevelAnswer(_Document):
    """The best measured configuration at one concurrency level."""

    trial_number: int
    config: SpecConfig
    speedup: float
    speedup_interval: Interval | None
    speculation_pays: bool


class AdaptiveSlot(_Document):
    candidate_steps: list[int]


class AdaptiveExport(_Document):
    """SGLang's adaptive-speculation config from the per-level answers."""

    fits: bool
    reason: str
    file_name: str
    config: dict[str, AdaptiveSlot] | None
    server_args: list[str]
    speedup_by_level: dict[str, float]


class GridCost(_Document):
    launches: int
    gpu_hours: float | None


class StudyCost(_Document):
    """Launches and GPU-hours spent, by kind, next to SGLang's bench_speculative grid."""

    launches: int
    gpu_hours: float
    launches_by_kind: dict[str, int]
    gpu_hours_by_kind: dict[str, float]
    median_launch_gpu_hours: float | None
    bench_speculative_grid: GridCost
    extra_passes: int = Field(description="passes a confirmation added on the warm server to resolve a tie")
    summary: str


class LaunchNoise(_Document):
    """The launch-to-launch noise every interval shown holds, and what it was estimated from."""

    sd: float
    relaunched: int
    degrees_of_freedom: float


class Refusal(_Document):
    """A worker that refused what the study asks (a study fault: it is not offered the study again)."""

    worker_id: str | None
    at: UtcDatetime
    message: str | None


class Eligibility(_Document):
    """Which workers can take a running study; `warning` names the requirement none meets."""

    eligible_workers: list[str]
    quarantined_workers: list[str]
    unmet: list[str]
    warning: str | None


class Deployment(_Document):
    """The answer to deploy: SGLang's server settings and the exact command (model paths are placeholders)."""

    mode: Mode
    speculation: bool
    reason: str
    sglang_version: str
    server: ServerSettings
    pin_max_running_requests: bool
    adaptive_config: dict[str, AdaptiveSlot] | None
    adaptive_file: str | None
    proven_levels: list[int] = Field(description="the concurrency levels this command was measured at")
    load_note: str = Field(description="what the command admits beyond the measured levels")
    load_line: str = Field(
        default="", description="printed right above the command: the loads it was proven at and what it admits"
    )
    proven_by: str | None = Field(description="the confirmation lease that started exactly this server")
    proof_note: str
    launch_command: str


class FlaggedTrial(_Document):
    """A trial whose stored record holds values that fail today's checks (shown without them)."""

    number: int
    problems: list[str]


class Spread(_Document):
    """The median of the rehearsals and the 80% range (10th to 90th percentile)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    expected: float
    low: float
    high: float

    def covers(self, value: float) -> bool:
        return self.low <= value <= self.high


class Estimate(_Document):
    """`spectune study plan`: what the study will likely spend, before any GPU is used."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workers: int = Field(description="hosts the study was rehearsed at (the eligible workers, or --workers)")
    draws: int = Field(description="rehearsals: engines drawn from the prior, each a whole study")
    launches: Spread = Field(description="server launches: baselines, search, confirmations, failed starts")
    gpu_hours: Spread = Field(description="GPU-hours: start-up, warm-up and benchmark x the spec's GPUs")
    wall_hours: Spread = Field(description="hours from the first launch to the answer")
    engines: str = Field(description="what the engines were drawn from, in words")

    def lines(self) -> list[str]:
        def row(name: str, s: Spread, fmt: str) -> str:
            return f"{name:<12} {format(s.expected, fmt):>8}   80% range {format(s.low, fmt)} - {format(s.high, fmt)}"

        return [
            f"estimate at {self.workers} worker(s), from {self.draws} rehearsals of this study on engines drawn "
            f"from the prior ({self.engines}):",
            row("launches", self.launches, ".0f"),
            row("GPU-hours", self.gpu_hours, ".2f"),
            row("wall hours", self.wall_hours, ".2f"),
        ]


class PlanCheck(_Document):
    """The estimate the study was created with (`spectune study plan`), and what it took once finished."""

    estimate: Estimate
    actual_launches: int | None = None
    actual_gpu_hours: float | None = None
    actual_wall_hours: float | None = Field(default=None, description="first launch to the answer")
    launches_inside: bool | None = Field(default=None, description="the launches fell in the estimate's 80% range")
    summary: str


class StudyDocument(_Document):
    """`GET /v1/studies/{name}`: state, counts, baselines, the best and the winner, the answer to deploy."""

    name: str
    state: StudyState
    phase: str = Field(description="search | confirmation while running; else done or stopped")
    finish_reason: str | None
    created_at: UtcDatetime
    finished_at: UtcDatetime | None
    spec: StudySpec
    workload: str = Field(description="the traffic every baseline and trial of this study measured, in words")
    objective: str = Field(default="", description="what the study is judged by, in words (its verdict's metric)")
    trials: TrialCounts
    configurations_launched: int
    baselines_measured: int
    baselines: list[HostBaseline] = Field(description="output tok/s without speculation per host and level")
    best: Winner | None = Field(description="the answer (the winner: confirmed, else the search's best)")
    best_measured: BestTrial | None = Field(description="the search's own best measured trial")
    winner: Winner | None
    best_static: Winner | None = Field(
        default=None,
        description="the best static configuration, when the answer (`best`, `winner`) is an adaptive server "
        "its own launch proved; None otherwise (`best` is then the static answer itself)",
    )
    confirmation: list[Confirmation]
    best_by_level: dict[str, LevelAnswer]
    launch_noise: LaunchNoise
    adaptive_spec: AdaptiveExport | None
    verdict: str
    outcome: Outcome = Field(
        default=Outcome.NO_ANSWER,
        description="the verdict in one word: pays | does_not_pay | cannot_tell_apart | no_answer "
        "(`spectune study best` exits 0, 3, 5 or 4 on them)",
    )
    host_check: str | None = Field(description="hosts whose baselines of the same server disagree beyond the noise")
    cost: StudyCost
    refused_by: list[Refusal]
    flagged_trials: list[FlaggedTrial] = Field(description="`spectune db repair-trial` removes their bad values")
    eligibility: Eligibility | None = Field(description="running studies only")
    plan: PlanCheck | None = Field(
        default=None, description="the estimate made at creation, against the actual once finished"
    )
    waiting: str | None = Field(
        default=None,
        description="a running study that runs nothing because its last lease was lost: what was lost, when, "
        "and that it is being reassigned (None while something runs)",
    )
    speculation_pays: bool | None = Field(description="None until something was measured")
    deployment: Deployment | None

    def printed_command(self) -> str | None:
        """The one command every renderer prints: the deployment's (the server a confirmation
        started, the baselines' server when speculation does not pay, else with its proof note);
        None when there is none (`printed_command_note` says why)."""
        return None if self.deployment is None else self.deployment.launch_command

    def adaptive_proven(self) -> bool:
        """Is the answer an adaptive server its own launch proved?  `best` and `winner` are then
        that launch's record, and `best_static` the best static configuration."""
        return self.best is not None and self.best.adaptive

    def printed_command_note(self) -> str:
        """What stands behind `printed_command`: the launch that started it, why it is not proven,
        or, with no command, the verdict saying why (e.g. no candidate's deployment started)."""
        dep = self.deployment
        if dep is None:
            return self.verdict
        if dep.proven_by:
            return f"launched exactly as printed (lease {dep.proven_by})"
        return dep.proof_note


class StudyBrief(_Document):
    """What `stop` answers for a study whose stored spec this version cannot read."""

    name: str
    state: StudyState
    finish_reason: str | None


class PruneNote(_Document):
    after_concurrency: int
    reason: str


class ModelPrediction(_Document):
    """What the `auto` sampler predicted for a configuration before its result came in: when it
    proposed it, or (a blind start) while it was in flight."""

    speedup: float
    log_sd: float
    # None where not estimated: a launch predicted in flight ("start" below) was not the model's
    # proposal, so nothing weighed its expected improvement, its risk of running out of memory or
    # its cost.
    expected_improvement: float | None
    observations: int
    p_oom: float | None
    predicted_cost_s: float | None
    # "model": the model's best value; "local": a neighbour of the incumbent, proposed because the
    # model failed its prediction check; "probe": one draft step past the deepest launch, before
    # the model rule may settle; "start": a starting point launched blind, predicted while it was in
    # flight by the first model that had not seen its result (optimizer.model_sampler).  Older
    # trials say none of them.
    move: Move = "model"
    # A "local" move: the incumbent it walked around (its configuration key).
    around: str | None = None


class TrialRow(_Document):
    """One trial of `GET /v1/studies/{name}/trials`."""

    number: int
    state: Literal["RUNNING", "COMPLETE", "PRUNED", "FAIL", "WAITING"]
    params: dict[str, int | float | str]
    config: SpecConfig | None
    speedup: float | None
    feasible: bool
    constraints: dict[str, float] | None
    speedup_by_level: dict[str, float] | None
    levels: list[MeasuredLevel] | None
    baseline_levels: list[MeasuredLevel] | None = Field(
        description="the baseline each level's speedup divides by (same host, measured before it)"
    )
    effective: dict[str, EffectiveValue] | None
    startup_s: float | None
    worker_id: str | None
    failure_kind: str | None
    failure_message: str | None
    record_problems: list[str] | None = Field(description="stored values left out: they fail today's checks")
    duplicate_of: int | None
    inferred_from: int | None = Field(description="not launched: needs at least the memory of this trial")
    pruned: PruneNote | None
    partial_speedup_by_level: dict[str, float] | None
    levels_measured: list[MeasuredLevel] | None = Field(
        description="a trial given up after its attempts: the levels they measured before the end"
    )
    source: str | None = Field(description="warm_start | prior_study | grid (enqueued), else the sampler's")
    model_prediction: ModelPrediction | None
    datetime_start: UtcDatetime | None
    datetime_complete: UtcDatetime | None
