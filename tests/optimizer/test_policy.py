"""One `Policy` (issue 31 item 4): every tuned decision value of `optimizer/` is a field of
`optimizer.policy.Policy`, the rules read it from the study's snapshot, and a changed field changes
the decision it governs."""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from optuna.trial import FrozenTrial

from optimizer import conductor as c
from optimizer import convergence, stop_rules
from optimizer.memory_store import MemoryStudy
from optimizer.policy import DEFAULT_POLICY, SNAPSHOT_FIELDS, Policy
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from optimizer.stop_rules import StopRule
from optimizer.study_state import Phase, StudyState
from tests.optimizer.test_convergence import ZIGZAG_RUN, _run_with_predictions
from tests.optimizer.test_convergence import spec as zigzag_spec
from tests.support.specs import small_spec

OPTIMIZER = pathlib.Path(__file__).resolve().parents[2] / "optimizer"

# Numeric module constants of optimizer/ that are not tuned decision values: physical and
# statistical facts, SGLang's own values, input limits, and numerical devices.  A new numeric
# module constant must be a Policy field or be added here with its reason.
NOT_POLICY: dict[str, str] = {
    "actions.MAX_DUPLICATE_PROPOSALS": "a loop bound: how often the sampler may repeat itself before the study says so",
    "estimate.DEFAULT_DRAWS": "the pre-study estimate's simulation size, not a search decision (benchmarks/plan_calibration.py)",
    "estimate.POSITIONS": "the pre-study estimate's simulation settings, not a search decision",
    "estimate.SPEC_HOST_SD": "the pre-study estimate's simulated host offsets, not a search decision",
    "estimate.WARMUP_S": "the pre-study estimate's simulated warm-up, not a search decision",
    "rehearsal.POLL_S": "the simulated worker's poll interval (the worker's own default)",
    "residual_gp.KEEP_SETTINGS": "numerics: a bound on the work per prediction",
    "residual_gp.MAX_LEVERAGE": "numerics: the leave-one-out inflation cap (a point fitted exactly)",
    "residual_gp._JITTER": "numerics: a Cholesky jitter",
    "verify_probe.DEFAULT_PREFIX_TOKENS": "the probe's measurement plan: a verify's context length",
    "verify_probe.MAX_BATCH_TOKENS": "SGLang: the smallest default chunked-prefill size",
    "verify_probe.PROBE_TOKENS": "SGLang: the draft token counts a tree can carry, up to 64",
    "verify_probe.SINGLE_RUN_SD": "the probe's measurement prior: a call's timing noise on a quiet host",
    "analysis.Z95": "statistics: the two-sided 95% normal quantile",
    "costs.GRID_STEPS": "SGLang: bench_speculative.py's grid",
    "costs.GRID_TOPK": "SGLang: bench_speculative.py's grid",
    "costs.GRID_NDT": "SGLang: bench_speculative.py's grid",
    "deploy.SPEC_DEFAULT_MAX_RUNNING_REQUESTS": "SGLang: its default with speculation",
    "deploy.DEFAULT_PORT": "SGLang: its default port",
    "launch_cost.N_FEATURES": "the launch-cost regression's shape",
    "memory_boundary._ANGLES": "numerics: the grid resolution of the boundary's direction",
    "memory_boundary._TIE": "numerics: loads this close are one load",
    "memory_boundary._MAX_SPAN": "numerics: an unbounded interval counted as this wide",
    "memory_boundary._SPEC_SIZES": "SGLang: its capture list with speculation",
    "model_sampler.MAX_SCORED": "compute: the most configurations scored per ask",
    "objective.FAILED_LAUNCH_VIOLATION": "an encoding: larger than any latency overrun, for Optuna",
    "objective.GOODPUT_FLOOR_SHARE": "measurement: the resolution of a benchmark of a few hundred requests",
    "plausibility.SPEEDUP_OVER_ACCEPT": "physics: speedup <= accept length, with noise room",
    "plausibility.ACCEPT_OVER_STEPS": "SGLang: accept length <= steps + 1, with noise room",
    "plausibility.BASELINE_FACTOR": "physics: GPUs' memory bandwidth spread (H200 to L40S 5.6x)",
    "plausibility.PACE_SLACK_S": "input check: clock granularity of a report",
    "plausibility.PACE_CHECKED_BELOW_TOK_S": "input check: far below the slowest server seen",
    "sglang.ADAPTIVE_SINCE": "SGLang: the version with adaptive speculation",
    "sglang.ADAPTIVE_STEPS_OFF_SINCE": "SGLang: a version",
    "spec.MAX_SEED": "input limit",
    "spec.MAX_HOURS": "input limit",
    "spec.MAX_PATIENCE": "input limit",
    "spec.MAX_INT_ARG": "input limit",
    "spec.MAX_FLOAT_ARG": "input limit",
    "spec.MAX_SPACE_CONFIGS": "input limit",
    "spec.MAX_GRID_CONFIGS": "input limit",
    "spec.MAX_LEVEL_S": "input limit",
    "spec.FLOOR_TOK_S_PER_REQUEST": "input check: a workload no server is that slow at",
}


def _numeric(node: ast.expr) -> bool:
    """A value written as numbers: a literal, arithmetic of literals, a tuple of them, math.log of
    them, or a range of them spread into a tuple."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int | float) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    if isinstance(node, ast.Tuple | ast.List):
        return bool(node.elts) and all(_numeric(e) for e in node.elts)
    if isinstance(node, ast.Starred):
        return _numeric(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute):
        name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
        return name in ("range", "log", "sqrt", "exp") and all(_numeric(a) for a in node.args)
    return False


def numeric_constants() -> dict[str, int]:
    """Every module-level UPPER_CASE name in optimizer/*.py assigned a number, with its line."""
    out: dict[str, int] = {}
    for path in sorted(OPTIMIZER.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for t in targets:
                if isinstance(t, ast.Name) and t.id.lstrip("_").isupper() and _numeric(value):
                    out[f"{path.stem}.{t.id}"] = node.lineno
    return out


def test_every_numeric_constant_left_in_the_optimizer_is_a_listed_fact() -> None:
    found = numeric_constants()
    tuned = sorted(f"{k} (line {line})" for k, line in found.items() if k not in NOT_POLICY)
    assert not tuned, f"tuned values belong in optimizer.policy.Policy, or in NOT_POLICY with a reason: {tuned}"
    # The list stays honest: each fact it names is still a numeric constant.
    assert sorted(set(NOT_POLICY) - set(found)) == []


def test_the_walk_catches_a_tuned_constant_added_as_a_module_global() -> None:
    tree = ast.parse("NEW_BAR = 0.25\nPAIR = (1, -2.0)\nSIZES = (*range(1, 9),)\nNAME = 'x'\nMEMO = Memo(256)\n")
    values = {t.targets[0].id: _numeric(t.value) for t in tree.body if isinstance(t, ast.Assign)}  # type: ignore[attr-defined]
    assert values == {"NEW_BAR": True, "PAIR": True, "SIZES": True, "NAME": False, "MEMO": False}


def test_every_field_says_where_its_value_comes_from() -> None:
    source = (OPTIMIZER / "policy.py").read_text()
    lines = source.splitlines()
    for f in dataclasses.fields(Policy):
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{f.name}:"))
        comment = []
        i = at - 1
        while lines[i].strip().startswith("#"):
            comment.append(lines[i])
            i -= 1
        # A field shares the comment of the group it is written in (the priors, the noise pair).
        assert comment or lines[at - 1].strip().endswith(")") or ":" in lines[at - 1], f.name
    assert SNAPSHOT_FIELDS <= {f.name for f in dataclasses.fields(Policy)}


# --------------------------------------------------------------------------- a field governs its rule


def test_the_improvement_rate_backstop_reads_stall_min_from_the_policy() -> None:
    # The same nine zigzag-tiles launches the backstop ends with the default policy
    # (tests/optimizer/test_convergence.py): with stall_min 12 it still waits.
    extra = [
        SpecConfig(num_steps=1, topk=1, num_draft_tokens=2),
        SpecConfig(num_steps=2, topk=2, num_draft_tokens=3),
        SpecConfig(num_steps=4, topk=1, num_draft_tokens=5),
        SpecConfig(num_steps=3, topk=4, num_draft_tokens=6),
    ]
    trials = _run_with_predictions(ZIGZAG_RUN + extra, miss=1.0)
    # The model rule asking of the configurations' values keeps a chance open here (as the test
    # in test_convergence.py sets it up), so the backstop is what settles.
    keeps = dataclasses.replace(DEFAULT_POLICY, answer_moves=False)
    default = convergence.assess(zigzag_spec(), trials, keeps)
    assert default.settled and default.rule is StopRule.IMPROVEMENT_RATE, default.reason
    patient = convergence.assess(zigzag_spec(), trials, dataclasses.replace(keeps, stall_min=12))
    assert not patient.settled, patient.reason


def test_the_prediction_check_reads_its_level_from_the_policy() -> None:
    # Predictions 25% off: the default check distrusts the model and the empirical rule stops the
    # study; at check_level 1.0 (the check off) the model stays trusted and the empirical rule
    # never speaks.
    trials = _run_with_predictions(ZIGZAG_RUN, miss=1.25)
    default = convergence.assess(zigzag_spec(), trials)
    assert default.rule is StopRule.EMPIRICAL and not default.model_trusted, default.reason
    off = dataclasses.replace(DEFAULT_POLICY, check_level=1.0)
    assert stop_rules.prediction_check(trials, off).trusted
    kept = convergence.assess(zigzag_spec(), trials, off)
    assert kept.model_trusted and kept.rule is not StopRule.EMPIRICAL, kept.reason


T0 = datetime(2026, 12, 4, 9, 0, tzinfo=UTC)


def _running(number: int) -> c.LeaseView:
    return c.LeaseView(f"t{number}", "trial", "active", trial_number=number, worker_id=f"w{number}")


def _snapshot(spec: StudySpec, trials: Sequence[FrozenTrial], policy: Policy, flying: int) -> c.Snapshot:
    hosts = [c.HostView(f"w{k}", T0) for k in range(4)]
    return c.Snapshot(
        spec=spec,
        state=StudyState.RUNNING,
        phase=Phase.SEARCH,
        created_at=T0 - timedelta(hours=1),
        now=T0,
        trials=trials,
        launched=frozenset(),
        leases=[_running(k) for k in range(flying)],
        baselines=[c.Baseline(k, f"w{k}", T0 - timedelta(minutes=5), {1: 100.0}) for k in range(4)],
        hosts=hosts,
        policy=policy,
    )


def test_the_parallel_cap_reads_model_parallel_from_the_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    # The model has its first results and is unsure (a 50% chance left): two proposals in flight
    # hold the next host back under the default policy; a policy allowing three lets it ask.
    unsure = convergence.Assessment(False, "unsure", 5, 100, 0.5, "k", 1.0, None)
    seen: list[Policy] = []

    def assess(spec: StudySpec, trials: list[FrozenTrial], policy: Policy = DEFAULT_POLICY, *_: object) -> Any:
        seen.append(policy)
        return unsure

    monkeypatch.setattr(convergence, "assess", assess)
    spec = StudySpec.model_validate(small_spec("policy-cap"))
    wider = dataclasses.replace(DEFAULT_POLICY, model_parallel=3)
    held = c.next_action(_snapshot(spec, [], DEFAULT_POLICY, 2), "w3")
    assert isinstance(held, c.Wait) and "at most 2 at once" in held.reason, held
    spec3 = spec.model_copy(update={"name": "policy-cap-3"})
    assert isinstance(c.next_action(_snapshot(spec3, [], wider, 2), "w3"), c.Ask)
    # The rule was handed the snapshot's policy, not a module's.
    assert wider in seen


# --------------------------------------------------------------------------- the policy travels


def test_the_policy_round_trips_through_the_snapshot_and_its_json() -> None:
    p = DEFAULT_POLICY.with_overrides(["stall_min=11", "depth_probe=off", "belief_margin=0.25"])
    assert p.changed() == {"stall_min": 11, "depth_probe": False, "belief_margin": 0.25}
    spec = StudySpec.model_validate(small_spec("policy-trip"))
    snap = MemoryStudy(spec, T0, policy=p).snapshot(T0, ["w1"])
    assert snap.policy == p and dataclasses.replace(snap, now=T0 + timedelta(seconds=1)).policy == p
    assert Policy.from_json(json.loads(json.dumps(p.as_json()))) == p
    assert Policy.from_json(json.loads(json.dumps(DEFAULT_POLICY.as_json()))) == DEFAULT_POLICY


def test_a_benchmark_cannot_set_what_the_snapshot_does_not_carry() -> None:
    with pytest.raises(ValueError, match="key=value"):
        DEFAULT_POLICY.with_overrides(["no_such_field=1"])
    with pytest.raises(ValueError, match="not a int"):
        DEFAULT_POLICY.with_overrides(["stall_min=many"])
    # Judged at the service's edge, where no snapshot is built: a change there would not be made.
    with pytest.raises(ValueError, match="service's edge"):
        DEFAULT_POLICY.with_overrides(["z_prune=3.0"])


def test_the_samplers_geometry_travels_with_the_studys_policy() -> None:
    """`lose_by`, `near_copy` and `local_radii` are the snapshot's (a benchmark may vary them) and
    the sampler reads the study's values, not the default's."""
    import random

    from optimizer import model_sampler as M
    from optimizer.space import SearchSpace
    from tests.optimizer.test_answer_moves import EIGHT
    from tests.optimizer.test_convergence import measured

    assert DEFAULT_POLICY.with_overrides(["lose_by=0.0", "near_copy=0.25"]).changed() == {
        "lose_by": 0.0,
        "near_copy": 0.25,
    }
    trials = measured("dense-8b-h100", EIGHT[:5])
    best = max(float(t.value or 0.0) for t in trials)
    default = M.propose(zigzag_spec(), trials, random.Random(0))
    strict = M.propose(zigzag_spec(), trials, random.Random(0), policy=dataclasses.replace(DEFAULT_POLICY, lose_by=0.0))
    assert default is not None and strict is not None
    # The default lets the model's best value be a hair below the best measured; a policy that
    # allows no loss at all proposes only what the model predicts to beat it.
    assert default.predicted_speedup < best <= strict.predicted_speedup and strict.purpose is None
    # A configuration half a lattice step from one in flight: a near-copy at the default 0.75,
    # worth something at 0.25.
    here, near = (
        SpecConfig(num_steps=4, topk=2, num_draft_tokens=8),
        SpecConfig(num_steps=5, topk=2, num_draft_tokens=8),
    )
    assert M.pending_penalty([near], [here]).tolist() == [0.0]
    assert M.pending_penalty([near], [here], 0.25)[0] > 0.0
    # The walk's rings: the second ring only where the policy says so.
    space = SearchSpace()
    ref = SpecConfig(num_steps=5, topk=4, num_draft_tokens=14)
    pool = [c for c in M.space_configs(space) if c.key != ref.key]
    first = M.local_moves(ref, pool, space)
    wider = M.local_moves(ref, pool, space, radii=(2.0,))
    assert set(first.index.tolist()) < set(wider.index.tolist())


def test_the_performance_model_fits_under_the_studys_policy() -> None:
    """The model's priors, noise, knees, residual grid and floors are the snapshot's: a benchmark
    may set them (a grid or a prior as comma-separated numbers), the fit keeps the policy it ran
    under, and the stop rule and the ranking read the study's, not the default's."""
    from optimizer import perf_model, ranking
    from optimizer.model_sampler import observations_of
    from tests.optimizer.test_answer_moves import EIGHT
    from tests.optimizer.test_convergence import measured

    wide = DEFAULT_POLICY.with_overrides(["model_floor=0.2", "residual_amplitudes=0.01,0.02", "accept_first=1.0,0.5"])
    assert wide.changed() == {"model_floor": 0.2, "residual_amplitudes": (0.01, 0.02), "accept_first": (1.0, 0.5)}
    with pytest.raises(ValueError, match="give 2 comma-separated numbers"):
        DEFAULT_POLICY.with_overrides(["accept_first=1.0"])
    with pytest.raises(ValueError, match="not a float"):
        DEFAULT_POLICY.with_overrides(["residual_amplitudes=0.01,lots"])

    trials = measured("dense-8b-h100", EIGHT[:5])
    sp = zigzag_spec()
    default = perf_model.fit(observations_of(trials), sp.search_space.num_steps.high)
    fitted = perf_model.fit(observations_of(trials), sp.search_space.num_steps.high, None, wide)
    assert default is not None and fitted is not None and fitted.policy == wide
    cand = perf_model.Candidates.of(EIGHT[5:])
    _, sd_default = default.predict_log_speedup(cand, [1], [1.0])
    _, sd_wide = fitted.predict_log_speedup(cand, [1], [1.0])
    # The floor is the policy's: no prediction claims less than 20% where the study says so.
    assert sd_default.max() < 0.2 <= sd_wide.min()
    # The residual grid is the policy's too: only its two amplitudes are weighed.
    assert fitted.al_gp is not None and {s.amp for s in fitted.al_gp.settings} <= {0.01, 0.02}
    # The stop rule fits under the study's policy: with a 20% floor the open configurations keep
    # a chance the default's model rules out.
    a_default = convergence.assess(sp, trials)
    a_wide = convergence.assess(sp, trials, wide)
    assert a_wide.best_chance > a_default.best_chance, (a_wide, a_default)
    # The ranking (of a run whose predictions held) is memoised per policy: the study's floor,
    # not the first caller's.
    held = _run_with_predictions(ZIGZAG_RUN, miss=1.0)
    r_default, r_wide = ranking.of(sp, held), ranking.of(sp, held, policy=wide)
    assert r_default is not None and r_wide is not None
    assert r_wide.floor_sd == 0.2 and r_default.floor_sd == DEFAULT_POLICY.model_floor
    assert r_wide.model.policy == wide
