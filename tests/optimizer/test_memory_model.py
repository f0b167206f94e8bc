"""The memory model in the deployment's terms (optimizer.memory_boundary, optimizer.deployability)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState, create_trial

from optimizer import deploy
from optimizer.deployability import smallest_deployment, weigh
from optimizer.memory_boundary import (
    Launch,
    MemoryBoundary,
    Terms,
    capture_list,
    judge,
    tuning_launches,
)
from optimizer.model_sampler import propose, space_configs
from optimizer.plan import server_settings
from optimizer.policy import DEFAULT_POLICY
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec, parse_spec
from spectune_sim.landscapes import LANDSCAPES
from spectune_sim.model import check_memory, predict

optuna.logging.set_verbosity(optuna.logging.WARNING)


def spec(serving: dict[str, int] | None = None, levels: tuple[int, ...] = (16,)) -> StudySpec:
    doc: dict[str, Any] = {
        "name": "m",
        "model": {"target": "t", "draft": "d"},
        "workload": {"concurrency": list(levels)},
        "sampler": "auto",
        "seed": 1,
    }
    if serving is not None:
        doc["serving"] = serving
    return parse_spec(doc)


def t(sizes: int, batch: int, ndt: int, width: int = 0) -> Terms:
    return Terms(sizes, batch, ndt, width)


def test_capture_list_follows_sglang() -> None:
    s = spec({"max_running_requests": 48})
    tuning = server_settings(s, SpecConfig(num_steps=3, topk=1, num_draft_tokens=4))
    assert capture_list(tuning) == (16,)  # only the measured level
    printed, _ = deploy.deployment_settings(s, SpecConfig(num_steps=3, topk=1, num_draft_tokens=4))
    sizes = capture_list(printed)
    assert len(sizes) == 23 and sizes[-1] == 48  # docs/sglang.md §3: 23 sizes up to 48
    assert capture_list(printed.model_copy(update={"max_running_requests": 20})) == (
        *range(1, 9),
        10,
        12,
        14,
        16,
        18,
        20,
    )


def test_no_failure_no_boundary() -> None:
    assert MemoryBoundary.fit([Launch(t(1, 16, 8), True, "a")]) is None
    assert judge(None, t(23, 48, 64)).p_fail == 0.0


def test_a_start_in_a_small_envelope_is_evidence_about_the_big_one_only_as_far_as_the_terms_say() -> None:
    # Started with graphs for batch 16 (one size), ran out of memory at 16 draft tokens there.
    launches = [Launch(t(1, 16, 6, 3), True, "small"), Launch(t(1, 16, 16, 3), False, "big")]
    b = MemoryBoundary.fit(launches)
    assert b is not None
    assert b.p_fail([t(1, 16, 6, 3)])[0] == pytest.approx(0.0)  # what started starts
    assert b.p_fail([t(1, 16, 16, 3)])[0] == pytest.approx(1.0)  # what failed fails
    # The same configuration with graphs up to 48 (23 sizes): three times the batch x draft tokens
    # of a start that sat at 6/16 of the failure: past the failure in every term.
    assert b.p_fail([t(23, 48, 6, 3)])[0] == pytest.approx(1.0)
    # Graphs up to 24 with few sizes: between what started and what failed, so uncertain.
    mid = b.p_fail([t(2, 24, 6, 3)])[0]
    assert 0.0 < mid < 1.0
    # A deployment that ran out of memory teaches the boundary in its own envelope.
    more = MemoryBoundary.fit([*launches, Launch(t(12, 16, 6, 3), False, "deploy 16")])
    assert more is not None and more.p_fail([t(12, 16, 6, 3)])[0] == pytest.approx(1.0)
    assert more.p_fail([t(12, 16, 4, 3)])[0] > b.p_fail([t(12, 16, 4, 3)])[0]


def test_monotone_in_every_term() -> None:
    rng = random.Random(0)
    # Launches in several envelopes, answered by one true engine (graph memory linear in the terms).
    launches = []
    for i in range(12):
        x = t(rng.choice([1, 2, 12]), rng.choice([8, 16]), rng.randint(2, 40), rng.randint(0, 16))
        launches.append(Launch(x, 0.02 * x.sizes + 0.001 * x.xv + 0.0002 * x.xd <= 0.5, str(i)))
    assert not all(x.started for x in launches)
    b = MemoryBoundary.fit(launches)
    assert b is not None
    for _ in range(200):
        base = t(rng.randint(1, 23), rng.randint(1, 48), rng.randint(2, 64), rng.randint(0, 32))
        p0 = b.p_fail([base])[0]
        for bigger in (
            t(base.sizes + 1, base.batch, base.draft_tokens, base.draft_width),
            t(base.sizes, base.batch + 4, base.draft_tokens, base.draft_width),
            t(base.sizes, base.batch, base.draft_tokens + 3, base.draft_width),
            t(base.sizes, base.batch, base.draft_tokens, base.draft_width + 2),
        ):
            assert b.p_fail([bigger])[0] >= p0 - 1e-12


def test_every_judgement_states_its_reason() -> None:
    b = MemoryBoundary.fit(
        [Launch(t(1, 16, 6), True, "3/1/6 (trial 2)"), Launch(t(1, 16, 20), False, "5/2/20 (trial 4)")]
    )
    assert b is not None
    assert "5/2/20 (trial 4), which ran out of memory" in b.judge(t(23, 48, 20)).reason
    assert "3/1/6 (trial 2), which started" in b.judge(t(1, 16, 4)).reason
    mid = b.judge(t(1, 16, 12))
    assert (
        0.0 < mid.p_fail < 1.0
        and "consistent with 1 start(s) and 1 out-of-memory launch(es) (the nearest: 5/2/20" in mid.reason
    )


# ---------------------------------------------------------------------------------------------
# The search, on the simulator's deploy-tight engine: tuning fits, graphs up to 48 do not.


def _trial(number: int, sp: StudySpec, config: SpecConfig) -> FrozenTrial:
    """A search trial as the simulator's engine answers it in the study's tuning envelope."""
    ls = LANDSCAPES["deploy-tight"]
    s = server_settings(sp, config)
    mem = check_memory(ls, config, max_running_requests=s.max_running_requests, cuda_graph_bs=s.cuda_graph_bs)
    attrs: dict[str, Any] = {"config": config.model_dump(mode="json"), "config_key": config.key}
    if not mem.ok:
        tr = create_trial(
            state=TrialState.COMPLETE,
            value=0.0,
            params={},
            distributions={},
            user_attrs=attrs | {"failure_kind": "oom"},
        )
        tr.number = number
        return tr
    levels, base = [], []
    for c in sp.workload.concurrency:
        p = predict(ls, config, c, max_running_requests=s.max_running_requests, cuda_graph_bs=s.cuda_graph_bs)
        b = predict(ls, None, c, max_running_requests=s.max_running_requests, cuda_graph_bs=s.cuda_graph_bs)
        levels.append({"concurrency": c, "output_tok_s": p.output_tok_s, "accept_length": p.accept_length,
                       "output_tok_s_runs": [p.output_tok_s] * 3})  # fmt: skip
        base.append({"concurrency": c, "output_tok_s": b.output_tok_s, "output_tok_s_runs": [b.output_tok_s] * 3})
    value = levels[0]["output_tok_s"] / base[0]["output_tok_s"]
    tr = create_trial(state=TrialState.COMPLETE, value=value, params={}, distributions={},
                      user_attrs=attrs | {"levels": levels, "baseline_levels": base})  # fmt: skip
    tr.number = number
    return tr


SEEN = [
    SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
    SpecConfig(num_steps=5, topk=2, num_draft_tokens=10),
    SpecConfig(num_steps=6, topk=4, num_draft_tokens=24),
    SpecConfig(num_steps=4, topk=1, num_draft_tokens=5),
    SpecConfig(num_steps=7, topk=8, num_draft_tokens=60),
    SpecConfig(num_steps=2, topk=1, num_draft_tokens=3),
]


def test_with_a_fallback_the_weight_is_the_tuning_envelopes() -> None:
    """Where serving leaves the graphs to us, the smallest deployment is the tuning envelope: the
    weight is exactly the chance the search launch fails."""
    sp = spec({"max_running_requests": 48})
    trials = [_trial(i, sp, c) for i, c in enumerate(SEEN)]
    assert any(tr.user_attrs.get("failure_kind") == "oom" for tr in trials)
    pool = list(space_configs(sp.search_space))
    w = weigh(sp, trials, pool)
    b = MemoryBoundary.fit(tuning_launches(sp, trials))
    assert b is not None
    tune = [Terms.of(server_settings(sp, c)) for c in pool]
    assert np.allclose(w.p_fail, b.p_fail(tune))
    assert smallest_deployment(sp, SEEN[0]).cuda_graph_bs == (16,)


def test_a_configuration_surely_undeployable_in_a_fixed_envelope_is_never_proposed() -> None:
    sp = spec({"max_running_requests": 48, "max_batch": 48})
    trials = [_trial(i, sp, c) for i, c in enumerate(SEEN)]
    pool = list(space_configs(sp.search_space))
    w = weigh(sp, trials, pool)
    b = MemoryBoundary.fit(tuning_launches(sp, trials))
    assert b is not None
    printed = [Terms.of(deploy.deployment_settings(sp, c)[0], c) for c in pool]
    sure = b.p_fail(printed) >= DEFAULT_POLICY.surely
    starts = [
        check_memory(LANDSCAPES["deploy-tight"], c, max_running_requests=48, cuda_graph_max_bs=48).ok for c in pool
    ]
    # Every configuration the model rules out is one the engine cannot start as printed, and
    # every one that starts as printed is kept.
    assert sure.any() and not any(s and k for s, k in zip(starts, sure, strict=True))
    assert not (w.keep & sure).any()
    assert all(k for s, k in zip(starts, w.keep, strict=True) if s)


def test_the_sampler_does_not_propose_what_surely_fails_to_deploy() -> None:
    """Four starts and one out-of-memory launch in the tuning envelope (graphs for batch 16): the
    best guess where a smaller deployment is allowed is, with graphs up to 48, surely out of
    memory; with the envelope fixed it is not proposed."""
    trials = _oom_scenario  # four starts, then one out-of-memory launch (below)

    fixed = spec({"max_running_requests": 48, "max_batch": 48})
    loose = spec({"max_running_requests": 48})
    b = MemoryBoundary.fit(tuning_launches(fixed, trials(fixed)))
    assert b is not None

    def p_deploy(c: SpecConfig) -> float:
        return float(b.p_fail([Terms.of(deploy.deployment_settings(fixed, c)[0], c)])[0])

    best_guess = propose(loose, trials(loose), random.Random(0))
    assert best_guess is not None and p_deploy(best_guess.config) >= DEFAULT_POLICY.surely
    chosen = propose(fixed, trials(fixed), random.Random(0))
    assert chosen is not None and chosen.config.key != best_guess.config.key
    assert p_deploy(chosen.config) < DEFAULT_POLICY.surely
    # Its risk of not deploying discounts it, and is what the proposal records.
    assert chosen.p_fail == pytest.approx(p_deploy(chosen.config))


# ---------------------------------------------------------------------------------------------
# Confirmation: the envelope a deployment is first launched in.


def _oom_scenario(sp: StudySpec) -> list[FrozenTrial]:
    starts = [
        SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
        SpecConfig(num_steps=4, topk=1, num_draft_tokens=5),
        SpecConfig(num_steps=2, topk=1, num_draft_tokens=3),
        SpecConfig(num_steps=5, topk=2, num_draft_tokens=10),
    ]
    failed = SpecConfig(num_steps=6, topk=4, num_draft_tokens=16)
    out = [_trial(i, sp, c) for i, c in enumerate(starts)]
    oom = {"config": failed.model_dump(mode="json"), "config_key": failed.key, "failure_kind": "oom"}
    tr = create_trial(state=TrialState.COMPLETE, value=0.0, params={}, distributions={}, user_attrs=oom)
    tr.number = len(out)
    return [*out, tr]


def test_confirmation_skips_an_envelope_the_model_says_surely_fails_and_says_why() -> None:
    sp = spec({"max_running_requests": 48})
    trials = _oom_scenario(sp)
    cand = SpecConfig(num_steps=4, topk=2, num_draft_tokens=5)
    # Nothing learnt: the printed envelope first.
    assert [t for t, _ in deploy.envelopes_to_try(sp, cand)] == [0, 1, 2]
    tiers = deploy.envelopes_to_try(sp, cand, trials=trials)
    assert [t for t, _ in tiers] == [1, 2]
    note = tiers[0][1].note
    assert (
        note.startswith("CUDA graphs up to batch 16")
        and "the printed envelope (23 captured sizes up to batch 48" in note
    )
    assert "sure to run out of memory" in note
    # A smaller configuration the model is not sure about is still tried as printed.
    assert [
        t for t, _ in deploy.envelopes_to_try(sp, SpecConfig(num_steps=1, topk=1, num_draft_tokens=2), trials=trials)
    ][0] == 0


def test_a_failed_deployment_teaches_the_model_for_other_candidates() -> None:
    """After 4/8/12 ran out of memory with graphs up to 48, 3/8/10 (fewer draft tokens, so the
    dominance rule alone would launch it as printed) is judged by the model in the same terms."""
    sp = spec({"max_running_requests": 48})
    trials = [_trial(i, sp, c) for i, c in enumerate(SEEN[:4])]
    failed = [(SpecConfig(num_steps=4, topk=8, num_draft_tokens=12), 0)]
    b = MemoryBoundary.fit([*tuning_launches(sp, trials), *deploy.deployment_launches(sp, failed)])
    assert b is not None
    cand = SpecConfig(num_steps=4, topk=8, num_draft_tokens=11)
    printed = Terms.of(deploy.deployment_envelopes(sp, cand)[0].settings, cand)
    j = b.judge(printed)
    assert j.p_fail >= DEFAULT_POLICY.surely and "the deployment of 4/8/12" in j.reason
    assert [t for t, _ in deploy.envelopes_to_try(sp, cand, failed, trials)][0] == 1


def test_the_last_envelope_is_never_skipped_on_the_models_word_alone() -> None:
    sp = spec({"max_running_requests": 48})
    trials = _oom_scenario(sp)
    huge = SpecConfig(num_steps=8, topk=8, num_draft_tokens=64)
    tiers = deploy.envelopes_to_try(sp, huge, trials=trials)
    assert [t for t, _ in tiers] == [2]
    assert "was not launched" in tiers[0][1].note


def test_the_conductor_confirms_a_candidate_in_the_envelope_the_model_leaves() -> None:
    """The conductor's candidates carry the first envelope worth launching: with graphs up to 48
    surely out of memory for 5/2/10 (by the search's own launches), graphs up to 16."""
    from datetime import UTC, datetime

    from optimizer import conductor as cd
    from optimizer.study_state import Phase, StudyState

    doc = spec({"max_running_requests": 48}).model_dump(mode="json")
    sp = parse_spec(doc | {"confirmation": {"top": 1}, "budget": {"max_trials": 5, "converge": False}})
    trials = _oom_scenario(sp)
    best = next(t for t in trials if t.user_attrs["config_key"] == "s5-k2-n10-bsauto")
    best.value = 2.5  # the search's leader
    now = datetime(2026, 12, 1, tzinfo=UTC)
    snap = cd.Snapshot(
        spec=sp, state=StudyState.RUNNING, phase=Phase.SEARCH, created_at=now, now=now, trials=trials,
        launched=frozenset(t.user_attrs["config_key"] for t in trials), leases=(), baselines=(),
    )  # fmt: skip
    (chosen,) = cd.candidates(snap)
    assert chosen.config.key == "s5-k2-n10-bsauto"
    assert chosen.tier == 1 and chosen.envelope is not None and "was not launched" in chosen.envelope.note


def test_a_kv_pool_failure_says_nothing_about_the_graph_terms() -> None:
    sp = spec({"max_running_requests": 48})
    ok = _trial(0, sp, SpecConfig(num_steps=3, topk=1, num_draft_tokens=4))
    cfg = SpecConfig(num_steps=2, topk=1, num_draft_tokens=3)
    kv = create_trial(
        state=TrialState.COMPLETE, value=0.0, params={}, distributions={},
        user_attrs={"config": cfg.model_dump(mode="json"), "config_key": cfg.key, "failure_kind": "oom",
                    "failure_message": "Not enough memory for the KV cache pool (token_to_kv_pool)"},
    )  # fmt: skip
    kv.number = 1
    assert [x.started for x in tuning_launches(sp, [ok, kv])] == [True]
    graph = create_trial(
        state=TrialState.COMPLETE, value=0.0, params={}, distributions={},
        user_attrs={"config": cfg.model_dump(mode="json"), "config_key": cfg.key, "failure_kind": "oom",
                    "failure_message": "CUDA out of memory while capturing cuda graph"},
    )  # fmt: skip
    graph.number = 2
    assert [x.started for x in tuning_launches(sp, [ok, graph])] == [True, False]
