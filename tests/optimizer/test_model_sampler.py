"""The model behind `sampler: auto`, OOM dominance, and the per-concurrency export (no database)."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime
from typing import Any, get_args

import optuna
import pytest

from api.documents import ModelPrediction
from optimizer import attrs as A
from optimizer import study as opt
from optimizer.answer import adaptive_export, best_by_level, check_adaptive_config
from optimizer.infeasible import needs_at_least
from optimizer.memory_store import MemoryStudy
from optimizer.model_sampler import Move, Proposal, _record_in_flight, blind_start, prediction_attr, propose
from optimizer.perf_model import fit, observations_from_attrs
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.space import SearchSpace, SpecConfig
from optimizer.spec import parse_spec
from spectune_sim.landscapes import LANDSCAPES
from spectune_sim.model import true_optimum
from tests.support.search import frozen_trial as _frozen
from tests.support.search import trial_attrs as attrs_for

optuna.logging.set_verbosity(optuna.logging.WARNING)


def spec(**kw: Any) -> Any:
    base: dict[str, Any] = {"name": "m", "model": {"target": "t", "draft": "d"}, "seed": 1, "sampler": "auto"}
    base.update(kw)
    return parse_spec(base)


def value_of(a: dict[str, Any]) -> float:
    vals = list(a["speedup_by_level"].values())
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


@pytest.mark.parametrize("landscape", ["moe-pcie", "dense-8b-h100", "no-gain"])
def test_auto_reaches_the_optimum_in_a_few_trials(landscape: str) -> None:
    """The service's loop in memory: warm starts, then model proposals, measured with the simulator."""
    sp = spec()
    storage = optuna.storages.InMemoryStorage()
    opt.create_study(storage, sp)
    seen: set[str] = set()
    best = 0.0
    for _ in range(8):
        study = opt.load_study(storage, sp)
        asked = opt.ask(study, sp)
        assert asked.config.key not in seen, "the model proposed a configuration already measured"
        seen.add(asked.config.key)
        a = attrs_for(landscape, asked.config, [1])
        opt.tell_value(study, asked.number, value_of(a), 0.0, a)
        best = max(best, value_of(a))
    _, optimum = true_optimum(LANDSCAPES[landscape], SearchSpace(), 1)
    assert best >= 0.98 * optimum, (best, optimum)


def test_a_fleet_asking_before_any_result_launches_published_configurations_not_random_ones() -> None:
    """Four workers ask at once: SGLang's two defaults, then the published chain of 7 and 4-wide
    tree of 16 (optimizer.space.PUBLISHED_STARTS); once they are taken, TPE's random start.  A
    result in, the model proposes."""
    sp = spec()
    storage = optuna.storages.InMemoryStorage()
    opt.create_study(storage, sp)
    study = opt.load_study(storage, sp)
    blind = [opt.ask(study, sp) for _ in range(5)]
    keys = [a.config.key for a in blind]
    assert keys[:4] == ["s3-k1-n4-bsauto", "s5-k4-n8-bsauto", "s7-k1-n8-bsauto", "s4-k4-n16-bsauto"], keys
    assert len(set(keys)) == 5
    # Graph sizes tuned: the published starts take the largest, as the defaults do.
    tuned = spec(name="m-graph", search_space={"cuda_graph_max_bs": [8, 32]})
    opt.create_study(storage, tuned)
    study = opt.load_study(storage, tuned)
    assert [opt.ask(study, tuned).config.key for _ in range(4)][2:] == ["s7-k1-n8-bs32", "s4-k4-n16-bs32"]
    # A busy workload (the objective at 32 requests or more): the short chains published there.
    # The objective's levels decide: a busy workload whose objective is one request is not busy.
    for name, levels, objective, starts in (
        ("m-busy", [64], {}, ["s2-k1-n3-bsauto", "s1-k1-n2-bsauto"]),
        ("m-mixed", [1, 32], {}, ["s2-k1-n3-bsauto", "s1-k1-n2-bsauto"]),
        ("m-sixteen", [16], {}, ["s7-k1-n8-bsauto", "s4-k4-n16-bsauto"]),
        ("m-busy-at-one", [1, 64], {"concurrency": 1}, ["s7-k1-n8-bsauto", "s4-k4-n16-bsauto"]),
    ):
        busy = spec(name=name, workload={"concurrency": levels}, **({"objective": objective} if objective else {}))
        opt.create_study(storage, busy)
        study = opt.load_study(storage, busy)
        assert [opt.ask(study, busy).config.key for _ in range(4)][2:] == starts, name
    # One result in: the model's proposal, which carries its prediction.
    a = attrs_for("dense-8b-h100", blind[0].config, [1])
    study = opt.load_study(storage, sp)
    opt.tell_value(study, blind[0].number, value_of(a), 0.0, a)
    nxt = opt.ask(study, sp)
    assert nxt.config.key not in keys
    assert "model_prediction" in opt.get_trial(study, nxt.number).user_attrs
    # Once anything has finished (here a start that ran out of memory, with no accept length),
    # what fails is the memory model's to say: no more published starts.
    assert blind_start(sp, study.get_trials(deepcopy=False)) is None
    fresh = spec(name="m-oom")
    opt.create_study(storage, fresh)
    study = opt.load_study(storage, fresh)
    first = opt.ask(study, fresh)
    opt.tell_infeasible(study, first.number, {"failure_kind": "oom"})
    assert blind_start(fresh, study.get_trials(deepcopy=False)) is None


def fleet_starts(name: str, n: int) -> tuple[Any, optuna.Study, list[opt.AskedTrial]]:
    """A study whose fleet asked for `n` starting points before any result (in memory)."""
    sp = spec(name=name)
    storage = optuna.storages.InMemoryStorage()
    opt.create_study(storage, sp)
    study = opt.load_study(storage, sp)
    return sp, study, [opt.ask(study, sp) for _ in range(n)]


def tell(study: optuna.Study, asked: opt.AskedTrial) -> optuna.trial.FrozenTrial:
    """Its result, measured on the simulator's dense-8b-h100 at one request."""
    a = attrs_for("dense-8b-h100", asked.config, [1])
    return opt.tell_value(study, asked.number, value_of(a), 0.0, a)


def test_starts_launched_blind_are_predicted_in_flight_once_and_checked_like_proposals() -> None:
    """A fleet's starts go out before the model has anything to stand on.  The first ask with a
    result in predicts the starts still in flight (by a model that has not seen their results),
    once: a later fit does not overwrite it.  Their results then count in the prediction check,
    as a proposal's would."""
    from optimizer import stop_rules

    sp, study, starts = fleet_starts("m-in-flight", 3)
    assert all("model_prediction" not in opt.get_trial(study, a.number).user_attrs for a in starts)

    tell(study, starts[0])
    nxt = opt.ask(study, sp)
    made = {s.number: opt.get_trial(study, s.number).user_attrs.get("model_prediction") for s in starts}
    assert made[starts[0].number] is None  # its result was in: nothing to predict
    for s in starts[1:]:
        pred = made[s.number]
        assert pred is not None and pred["move"] == "start" and pred["observations"] == 1, pred
        assert pred["speedup"] > 0 and pred["log_sd"] > 0
    assert opt.get_trial(study, nxt.number).user_attrs["model_prediction"]["move"] != "start"

    tell(study, starts[1])
    opt.ask(study, sp)
    again = opt.get_trial(study, starts[2].number).user_attrs["model_prediction"]
    assert again == made[starts[2].number]  # made once, by the fit that had not seen it
    check = stop_rules.prediction_check(study.get_trials(deepcopy=False))
    assert check.checked == 1  # the start's result against its in-flight prediction
    # The study document shows it, with what a proposal also estimates left out (not estimated).
    shown = ModelPrediction.model_validate(again)
    assert shown.move == "start" and shown.p_oom is None and shown.expected_improvement is None


def test_a_result_predicts_the_starts_still_in_flight_without_waiting_for_an_ask() -> None:
    """A fleet told to wait may make no ask before its starts come in: each result predicts the
    launches still in flight, from the results before it (its own is not stored yet)."""
    sp, study, starts = fleet_starts("m-told", 3)
    for s in starts[:2]:
        tell(study, s)
    attrs = {s.number: opt.get_trial(study, s.number).user_attrs for s in starts}
    assert "model_prediction" not in attrs[starts[0].number]  # no model before the first result
    assert "model_prediction" not in attrs[starts[1].number]  # told on the first result alone: no model yet
    pred = attrs[starts[2].number].get("model_prediction")
    assert pred is not None and pred["move"] == "start" and pred["observations"] == 1, pred


def test_a_failing_prediction_fails_no_ask_and_no_tell_and_a_tell_does_not_refit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The predictions run inside Optuna's ask and tell: if they raise, the ask still hands out a
    configuration and the result is still stored (a lease that fails there leaves a trial no one
    tells).  Building a `Trial` to tell a result (optimizer.study) predicts nothing."""
    import optimizer.model_sampler as ms

    sp, study, starts = fleet_starts("m-failing", 3)
    tell(study, starts[0])

    calls: list[int] = []

    def failing(spec: Any, trials: Any, model: Any, asking: int) -> Any:
        calls.append(asking)
        raise ValueError("Residuals are not finite")

    monkeypatch.setattr(ms, "in_flight_predictions", failing)
    nxt = opt.ask(study, sp)  # the model's proposal all the same
    assert calls == [nxt.number]
    assert "model_prediction" in opt.get_trial(study, nxt.number).user_attrs
    told = tell(study, starts[1])  # starts[2] unpredicted: tried
    assert told.state == optuna.trial.TrialState.COMPLETE and calls[-1] == starts[1].number
    assert opt.get_trial(study, starts[2].number).user_attrs.get("model_prediction") is None

    # Every launch in flight predicted: a tell fits nothing, in either hook.
    monkeypatch.undo()
    opt.ask(study, sp)  # predicts starts[2]
    monkeypatch.setattr(ms, "fit", lambda *_: pytest.fail("a tell refitted the model"))
    assert tell(study, starts[2]).state == optuna.trial.TrialState.COMPLETE


def test_an_enqueued_warm_start_predicts_the_starts_in_flight_and_a_failed_store_is_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A warm start the user enqueued takes its own params, but its ask still predicts the
    launches in flight; a prediction the storage fails to store is left out and the ask goes on."""
    sp, study, starts = fleet_starts("m-warm-in-flight", 2)
    tell(study, starts[0])
    warm = SpecConfig(num_steps=6, topk=1, num_draft_tokens=7)
    study.enqueue_trial({"num_steps": 6, "topk": 1})
    asked = opt.ask(study, sp)
    assert asked.config.key == warm.key  # the warm start's own params
    pred = opt.get_trial(study, starts[1].number).user_attrs.get("model_prediction")
    assert pred is not None and pred["move"] == "start"

    # A result in between the fit and the store (Optuna refuses to update a finished trial), or a
    # storage error: the prediction is left out, nothing raises.
    done = opt.get_trial(study, starts[0].number)
    _record_in_flight(study, [(done, {"speedup": 2.0, "log_sd": 0.1, "move": "start"})])
    assert opt.get_trial(study, starts[0].number).user_attrs.get("model_prediction") is None

    def broken(*_: object) -> None:
        raise optuna.exceptions.StorageInternalError("database is locked")

    monkeypatch.setattr(study._storage, "set_trial_user_attr", broken)
    running = opt.get_trial(study, asked.number)
    _record_in_flight(study, [(running, {"speedup": 2.0, "log_sd": 0.1, "move": "start"})])


WALK_FROM = SpecConfig(num_steps=6, topk=4, num_draft_tokens=16)


def distrusted_trials() -> list[optuna.trial.FrozenTrial]:
    """Five zigzag-tiles results, the best first, the other four 25% below the model's predictions
    of them: the default prediction check distrusts the model, and the sampler walks around the best."""
    best = WALK_FROM
    run = [
        best,
        SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
        SpecConfig(num_steps=2, topk=1, num_draft_tokens=3),
    ]
    run += [SpecConfig(num_steps=7, topk=8, num_draft_tokens=40), SpecConfig(num_steps=1, topk=2, num_draft_tokens=2)]
    trials = []
    for i, c in enumerate(run):
        a = attrs_for("zigzag-tiles", c, [1])
        if i > 0:  # predictions 25% off: the model fails its check
            a["model_prediction"] = {"speedup": value_of(a) * 1.25, "log_sd": 0.02, "move": "model"}
        trials.append(_frozen(i, value_of(a), a))
    return trials


def test_a_large_space_keeps_the_incumbents_neighbours_among_the_scored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above MAX_SCORED the sampler scores a random subset: the walk around the incumbent (a
    distrusted model) must still find the incumbent's neighbours in it."""
    import optimizer.model_sampler as ms

    monkeypatch.setattr(ms, "MAX_SCORED", 3)
    p = propose(spec(), distrusted_trials(), random.Random(0))
    assert p is not None and p.move == "local" and p.around == WALK_FROM.canonical().key, p


def test_the_sampler_trusts_the_model_where_the_studys_policy_switches_the_check_off() -> None:
    """`--policy check_level=1.0` switches the prediction check off in the stop rule; the sampler
    must read the same policy, or it walks around the incumbent for a rule that no longer waits
    for the walk.  Checked at `propose` and through the rehearsal's store (MemoryStudy -> the
    study's sampler), which is how a benchmark's policy reaches it."""
    off = DEFAULT_POLICY.with_overrides(["check_level=1.0"])
    trials = distrusted_trials()
    default = propose(spec(), trials, random.Random(0))
    assert default is not None and default.move == "local", default
    p = propose(spec(), trials, random.Random(0), policy=off)
    assert p is not None and p.move != "local", p

    def asked_move(policy: Policy) -> str:
        store = MemoryStudy(spec(), datetime(2026, 12, 4, tzinfo=UTC), policy=policy)
        study = store.study()
        for t in study.get_trials(states=(optuna.trial.TrialState.WAITING,)):
            study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)  # noqa: SLF001 - no warm starts here
        for t in trials:
            study.add_trial(t)
        asked = opt.ask(store.study(), store.spec)
        return str(opt.get_trial(store.study(), asked.number).user_attrs[A.MODEL_PREDICTION]["move"])

    assert asked_move(DEFAULT_POLICY) == "local"
    assert asked_move(off) != "local"


@pytest.mark.parametrize("move", get_args(Move))
def test_every_prediction_the_sampler_stores_is_one_the_study_document_shows(move: str) -> None:
    """A key or move the sampler adds must reach the typed document (api.documents), or every
    study route answers 500 for a study holding such a trial."""
    from api.documents import ModelPrediction

    p = Proposal(
        config=SpecConfig(num_steps=6, topk=4, num_draft_tokens=16),
        predicted_speedup=2.4, predicted_sd=0.03, expected_improvement=0.01, observations=5,
        move=move,  # type: ignore[arg-type]
        around="s6-k4-n15-bsauto" if move == "local" else None,
    )  # fmt: skip
    shown = ModelPrediction.model_validate(prediction_attr(p))
    assert shown.move == move and shown.around == p.around


def test_the_fit_recovers_accept_length_and_cost_from_a_few_trials() -> None:
    configs = [
        SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
        SpecConfig(num_steps=5, topk=4, num_draft_tokens=8),
        SpecConfig(num_steps=2, topk=2, num_draft_tokens=3),
        SpecConfig(num_steps=7, topk=1, num_draft_tokens=8),
    ]
    obs = []
    for c in configs:
        a = attrs_for("dense-8b-h100", c, [1, 4])
        obs += observations_from_attrs(a["config"], a["levels"], a["baseline_levels"])
    model = fit(obs, max_steps=10)
    assert model is not None
    for c in configs:
        measured = attrs_for("dense-8b-h100", c, [1])["levels"][0]["accept_length"]
        assert model.accept_length(c) == pytest.approx(measured, rel=0.03)


def test_proposals_skip_measured_running_and_known_oom_configurations() -> None:
    sp = spec(
        search_space={"num_steps": {"low": 1, "high": 4}, "topk": [1, 2, 4], "num_draft_tokens": {"low": 2, "high": 8}}
    )
    trials = []
    for i, c in enumerate(
        [SpecConfig(num_steps=3, topk=1, num_draft_tokens=4), SpecConfig(num_steps=2, topk=2, num_draft_tokens=3)]
    ):
        a = attrs_for("dense-8b-h100", c, [1])
        trials.append(_frozen(i, value_of(a), a))
    oom = SpecConfig(num_steps=1, topk=2, num_draft_tokens=3)
    trials.append(
        _frozen(
            2,
            0.5,
            {"config": oom.model_dump(mode="json"), "config_key": oom.key, "failure_kind": "oom"},
            violation=10.0,
        )
    )
    rng = random.Random(0)
    for _ in range(3):
        p = propose(sp, trials, rng)
        assert p is not None
        assert p.config.key not in {t.user_attrs["config_key"] for t in trials}
        assert not needs_at_least(p.config, oom), p.config
        a = attrs_for("dense-8b-h100", p.config, [1])
        trials.append(_frozen(len(trials), value_of(a), a))


def test_memory_dominance_is_componentwise() -> None:
    base = SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)
    assert needs_at_least(SpecConfig(num_steps=3, topk=4, num_draft_tokens=4), base)
    assert not needs_at_least(SpecConfig(num_steps=3, topk=4, num_draft_tokens=3), base)  # fewer draft tokens
    assert not needs_at_least(SpecConfig(num_steps=8, topk=1, num_draft_tokens=9), base)  # narrower
    big = base.model_copy(update={"cuda_graph_max_bs": 64})
    assert needs_at_least(big.model_copy(update={"cuda_graph_max_bs": 128}), big)
    assert not needs_at_least(big.model_copy(update={"cuda_graph_max_bs": 32}), big)


def _levels_study(landscape: str, configs: list[SpecConfig], levels: list[int]) -> list[Any]:
    return [_frozen(i, value_of(a), a) for i, c in enumerate(configs) for a in [attrs_for(landscape, c, levels)]]


def _route(doc: dict[str, Any], graph_bs: list[int], batch: int) -> list[int]:
    """SGLang's routing of a running batch: pad to the captured size, then the largest key not above it."""
    padded = next((b for b in sorted(graph_bs) if b >= batch), batch)
    keys = sorted(int(k) for k in doc)
    chosen = max([k for k in keys if k <= padded], default=keys[0])
    steps: list[int] = doc[str(chosen)]["candidate_steps"]
    return steps


def test_per_level_winners_export_as_sglang_adaptive_config() -> None:
    levels = [1, 16, 64]
    sp = spec(workload={"concurrency": levels})
    chains = [SpecConfig(num_steps=s, topk=1, num_draft_tokens=s + 1) for s in range(1, 8)]
    trials = _levels_study("moe-pcie", chains, levels)
    winners = best_by_level(sp, trials)
    exported = adaptive_export(sp, trials)
    assert exported is not None and exported.fits and exported.config is not None
    doc = exported.config
    # SGLang's rules: integer-string keys, non-empty lists of steps >= 0, initial steps among them,
    # chains only (draft tokens = steps + 1).
    assert set(doc) == {"1", "16", "64"}
    args = exported.server_args
    initial = int(args[args.index("--speculative-num-steps") + 1])
    assert (
        check_adaptive_config(doc, initial_steps=initial, topk=int(args[args.index("--speculative-eagle-topk") + 1]))
        == []
    )
    assert int(args[args.index("--speculative-num-draft-tokens") + 1]) == initial + 1
    assert "--speculative-adaptive" in args
    for c in levels:
        want = winners[c].config.num_steps if winners[c].pays else 0
        assert _route(doc, levels, c) == [want]
    # On moe-pcie a chain pays at low concurrency and not at 64 (verify cost grows with the batch).
    assert _route(doc, levels, 1)[0] > 0 and _route(doc, levels, 64) == [0]
    assert exported.speedup_by_level[64] == 1.0


def test_tree_winners_fall_back_to_the_best_chains_and_say_what_it_costs() -> None:
    levels = [1, 4]
    sp = spec(workload={"concurrency": levels})
    configs = [
        SpecConfig(num_steps=6, topk=8, num_draft_tokens=40),
        SpecConfig(num_steps=5, topk=2, num_draft_tokens=6),
    ]
    configs += [SpecConfig(num_steps=s, topk=1, num_draft_tokens=s + 1) for s in (3, 5)]
    exported = adaptive_export(sp, _levels_study("dense-8b-h100", configs, levels))
    assert exported is not None and not exported.fits and exported.config is not None
    assert "trees" in exported.reason and "best chain" in exported.reason
    assert all(v["candidate_steps"][0] in (3, 5) for v in exported.config.values())


def test_no_adaptive_export_when_speculation_pays_nowhere_or_with_one_level() -> None:
    chains = [SpecConfig(num_steps=s, topk=1, num_draft_tokens=s + 1) for s in (1, 3)]
    exported = adaptive_export(spec(workload={"concurrency": [1, 16]}), _levels_study("no-gain", chains, [1, 16]))
    assert exported is not None and exported.config is None and "no level" in exported.reason
    assert adaptive_export(spec(), _levels_study("no-gain", chains, [1])) is None


def test_sglang_rule_checker_rejects_what_sglang_rejects() -> None:
    assert check_adaptive_config({"1": {"candidate_steps": [1, 3]}}, initial_steps=3, topk=1) == []
    assert check_adaptive_config({"1": {"candidate_steps": [1, 3]}}, initial_steps=2, topk=1)
    assert check_adaptive_config({"1": {"candidate_steps": []}}, initial_steps=1, topk=1)
    assert check_adaptive_config({"1": {"candidate_steps": [-1]}}, initial_steps=1, topk=1)
    assert check_adaptive_config({"default": {"candidate_steps": [1]}}, initial_steps=1, topk=1)
    assert check_adaptive_config({"1": {"candidate_steps": [1]}}, initial_steps=1, topk=4)
