"""Optuna studies: warm start, grid, samplers over the canonical space, and what failures teach."""

from __future__ import annotations

from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from optimizer import study as opt
from optimizer.errors import StudyExistsError, TrialStateError
from optimizer.objective import CONSTRAINT_KEY, LevelResult, geometric_mean, score
from optimizer.space import SpecConfig
from optimizer.spec import Objective, parse_spec


def spec(**kw: Any) -> Any:
    base: dict[str, Any] = {"name": "st", "model": {"target": "t", "draft": "d"}, "seed": 3}
    base.update(kw)
    return parse_spec(base)


@pytest.fixture
def storage(db_url: str) -> Any:
    from api.db import engine_kwargs

    s = optuna.storages.RDBStorage(db_url, engine_kwargs=engine_kwargs(db_url), skip_table_creation=True)
    yield s
    s.engine.dispose()


def test_warm_start_puts_sglang_defaults_first(storage: Any) -> None:
    sp = spec()
    opt.create_study(storage, sp)
    study = opt.load_study(storage, sp)
    first, second = opt.ask(study, sp), opt.ask(opt.load_study(storage, sp), sp)
    assert first.config == SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    assert second.config == SpecConfig(num_steps=5, topk=4, num_draft_tokens=8)
    assert study.user_attrs[opt.SPEC_ATTR]["name"] == "st"
    assert study.metric_names == ["speedup"]
    with pytest.raises(StudyExistsError):
        opt.create_study(storage, sp)


def test_defaults_outside_the_space_are_not_enqueued(storage: Any) -> None:
    sp = spec(search_space={"num_steps": {"low": 1, "high": 2}, "topk": [1]})
    opt.create_study(storage, sp)
    study = optuna.load_study(study_name="st", storage=storage)
    assert study.get_trials(states=(TrialState.WAITING,)) == []


def test_grid_enqueues_the_valid_canonical_set(storage: Any) -> None:
    sp = spec(
        sampler="grid",
        search_space={"num_steps": {"low": 1, "high": 3}, "topk": [1, 2], "num_draft_tokens": {"low": 2, "high": 6}},
    )
    opt.create_study(storage, sp)
    expected = {c.key for c in sp.search_space.iter_configs()}
    seen = set()
    for _ in range(len(expected)):
        asked = opt.ask(opt.load_study(storage, sp), sp)
        seen.add(asked.config.key)
    assert seen == expected


@pytest.mark.parametrize("sampler", ["tpe", "gp", "random", "auto"])
def test_samplers_only_propose_valid_configs_and_learn_from_constraints(db_url: str, sampler: str) -> None:
    if db_url.startswith("postgresql"):
        pytest.skip("sampler behaviour does not depend on the backend; SQLite is enough")
    from api.db import engine_kwargs

    storage = optuna.storages.RDBStorage(db_url, engine_kwargs=engine_kwargs(db_url), skip_table_creation=True)
    sp = spec(
        sampler=sampler,
        search_space={
            "num_steps": {"low": 1, "high": 5},
            "topk": [1, 2, 4],
            "num_draft_tokens": {"low": 2, "high": 16},
        },
    )
    opt.create_study(storage, sp)
    for i in range(9):
        study = opt.load_study(storage, sp)
        asked = opt.ask(study, sp)
        assert sp.search_space.contains(asked.config)
        if asked.config.num_draft_tokens > 8:
            opt.tell_infeasible(study, asked.number, {"failure_kind": "oom"})
        else:
            value = 1.0 + 0.1 * asked.config.num_steps - 0.02 * asked.config.num_draft_tokens
            opt.tell_value(study, asked.number, value, 0.0, {"i": i})
    trials = optuna.load_study(study_name="st", storage=storage).get_trials()
    assert all(CONSTRAINT_KEY in t.constraints for t in trials if t.state == TrialState.COMPLETE)
    best = opt.best_trial_of(trials)
    assert best is not None and opt.is_feasible(best)
    storage.engine.dispose()


def test_infeasible_placeholder_is_the_worst_seen_and_never_best(storage: Any) -> None:
    sp = spec()
    opt.create_study(storage, sp)
    a = opt.ask(opt.load_study(storage, sp), sp)
    study = opt.load_study(storage, sp)
    opt.tell_value(study, a.number, 1.3, 0.0, {})
    b = opt.ask(opt.load_study(storage, sp), sp)
    opt.tell_value(opt.load_study(storage, sp), b.number, 0.9, 0.0, {})
    c = opt.ask(opt.load_study(storage, sp), sp)
    told = opt.tell_infeasible(opt.load_study(storage, sp), c.number, {"failure_kind": "oom"})
    assert told.value == 0.9 and told.constraints[CONSTRAINT_KEY] > 0
    assert opt.best_trial_of(opt.load_study(storage, sp).get_trials()).number == a.number  # type: ignore[union-attr]
    with pytest.raises(TrialStateError):
        opt.tell_value(opt.load_study(storage, sp), c.number, 2.0, 0.0, {})


def test_score_single_level_geomean_and_latency_constraint() -> None:
    levels = [LevelResult(1, 120.0, itl_ms_p99=11.0), LevelResult(8, 400.0, itl_ms_p99=30.0)]
    base = {1: 100.0, 8: 500.0}
    s1 = score(Objective(concurrency=1), levels, base)
    assert s1.value == pytest.approx(1.2) and s1.violation == 0.0
    s2 = score(Objective(), levels, base)
    assert s2.value == pytest.approx(geometric_mean([1.2, 0.8]))
    s3 = score(Objective(max_p99_itl_ms=20.0), levels, base)
    assert s3.violation == pytest.approx(0.5)


def test_ratio_interval_widens_with_noise_and_needs_two_passes() -> None:
    from optimizer.analysis import ratio_interval

    assert ratio_interval([100.0], [90.0, 91.0]) is None
    tight = ratio_interval([100.0, 100.5, 99.5], [90.0, 90.2, 89.8])
    loose = ratio_interval([100.0, 110.0, 90.0], [90.0, 99.0, 81.0])
    assert tight is not None and loose is not None
    assert tight.low < 100.0 / 90.0 < tight.high
    assert (loose.high - loose.low) > 5 * (tight.high - tight.low)
