"""Which confirmed candidate is the answer, judged on every launch (issue 17 item 4, small gains).

With launch-to-launch noise as large as the gaps between near-equal candidates, one confirmation
each cannot order them, and the cheapest of a "tie" may give up more than `min_gain`.  The
study's model of every search launch (optimizer.ranking) orders them; the cheaper tied one is
the answer only when that model is sure it gives up less than `min_gain`.  The printed numbers
stay the confirmation's.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import pytest
from optuna.trial import FrozenTrial, TrialState

from benchmarks.answer_quality import small_gain
from optimizer import attrs as A
from optimizer import ranking
from optimizer.analysis import Interval, ratio_interval
from optimizer.answer import Contender, choose
from optimizer.confirmation import candidates
from optimizer.policy import DEFAULT_POLICY
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from spectune_sim.model import predict
from tests.support.api_client import Api
from tests.support.search import key_of, lease, ok, sim_levels
from tests.support.specs import small_spec

T0 = datetime(2026, 12, 1, tzinfo=UTC).replace(tzinfo=None)


def _c(n: int, steps: int, topk: int, tokens: int, v: float, lo: float, hi: float) -> Contender:
    return Contender(n, SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=tokens), v, Interval(v, lo, hi))


@dataclass
class FakeRanking:
    estimates: dict[str, float]
    sure: bool
    # How many sd sure the model is that a cheaper one gives up less than min_gain (None: `sure`).
    within_sd: float | None = None

    def estimate(self, config: SpecConfig) -> float:
        return self.estimates[config.key]

    def surely_within(self, config: SpecConfig, best: SpecConfig, min_gain: float, z: float = 1.28) -> bool:
        return self.sure if self.within_sd is None else self.within_sd > z

    def beat_chance(self, config: SpecConfig, best: SpecConfig, min_gain: float) -> float:
        return 1.0 if self.estimate(config) > self.estimate(best) * (1.0 + min_gain) else 0.0


def _key(c: Contender) -> str:
    return c.config.key


def test_the_ranking_names_the_best_and_a_cheaper_tie_must_be_surely_within_min_gain() -> None:
    cheap = _c(1, 1, 2, 2, 1.060, 1.034, 1.086)  # the luckiest confirmation
    best = _c(2, 2, 2, 3, 1.052, 1.027, 1.079)
    other = _c(3, 2, 4, 3, 1.050, 1.025, 1.077)
    docs = [cheap, best, other]
    # Without a ranking: the best confirmation, which is also the cheapest.
    assert choose(docs).winner is cheap
    rank = FakeRanking({_key(cheap): 1.038, _key(best): 1.046, _key(other): 1.039}, sure=False)
    choice = choose(docs, 0.01, rank)
    assert choice.best is best and choice.winner is best
    assert choice.note is not None and "cannot show" in choice.note and "1/2/2" in choice.note
    # Where the model is sure the cheaper one gives up less than min_gain, it is the answer.
    sure = FakeRanking(rank.estimates, sure=True)
    assert choose(docs, 0.01, sure).winner is cheap
    # Measured more than min_gain behind the best: still not preferred, whatever the model says.
    behind = _c(1, 1, 2, 2, 1.030, 1.004, 1.056)
    assert choose([behind, best], 0.01, sure).winner is best


def test_where_the_model_ranks_two_launches_do_not_overrule_it() -> None:
    """The model's first is the best even against a candidate measured more than min_gain better
    on both its launches, however tightly (the overrule rule, removed at stop 42: it changed no
    answer on family engines 0-199 nor on two-peaks and small-gain, 20 seeds each).  Without a
    model, the two launches decide."""
    tree = replace(_c(9, 6, 4, 19, 2.240, 2.198, 2.284), search_speedup=2.236)
    chain = replace(_c(8, 6, 2, 7, 2.180, 2.139, 2.222), search_speedup=2.209)
    rank = FakeRanking({_key(tree): 2.207, _key(chain): 2.208}, sure=False)
    assert choose([tree, chain], 0.01, rank).best is chain
    tight = [replace(c, interval=Interval(c.speedup, c.speedup * 0.999, c.speedup / 0.999)) for c in (tree, chain)]
    assert choose(tight, 0.01, rank).best is tight[1]
    assert choose([tree, chain], 0.01).best is tree


# ------------------------------------------------------------------ the real model, side by side

LS = small_gain()
SEARCH = [
    SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
    for s, k, n in [(1, 1, 2), (1, 2, 2), (1, 4, 2), (2, 1, 3), (2, 2, 3), (2, 4, 3), (2, 8, 3), (3, 1, 4), (3, 2, 4)]
]
# The true best (2/2/3), one 1.2% and one 1.3% behind it (2/8/3, and the cheaper 1/2/2).
CANDIDATES = [SEARCH[4], SEARCH[6], SEARCH[1]]


def _levels(rng: random.Random, cfg: SpecConfig | None, launch_sd: float) -> list[dict[str, Any]]:
    p = predict(LS, cfg, 1, max_running_requests=1, cuda_graph_bs=(1,))
    launch = math.exp(rng.gauss(0.0, launch_sd))
    al = None if cfg is None else p.accept_length * math.exp(rng.gauss(0.0, 0.006))
    tok = p.output_tok_s * launch * (1.0 if al is None else al / p.accept_length)
    runs = [tok * math.exp(rng.gauss(0.0, 0.002)) for _ in range(3)]
    mean = sum(runs) / 3
    return [{"concurrency": 1, "output_tok_s": mean, "output_tok_s_runs": runs, "per_user_tok_s": mean,
             "accept_length": al}]  # fmt: skip


def _trial(number: int, cfg: SpecConfig, levels: list[Any], base: list[Any]) -> FrozenTrial:
    return FrozenTrial(
        number=number, state=TrialState.COMPLETE, value=levels[0]["output_tok_s"] / base[0]["output_tok_s"],
        datetime_start=T0, datetime_complete=T0, params={}, distributions={},
        user_attrs={A.CONFIG: cfg.model_dump(mode="json"), A.CONFIG_KEY: cfg.key, A.WORKER_ID: "h0",
                    A.LEVELS: levels, A.BASELINE_LEVELS: base},
        system_attrs={}, intermediate_values={}, trial_id=number,
    )  # fmt: skip


def _truth(cfg: SpecConfig) -> float:
    base = predict(LS, None, 1, max_running_requests=1, cuda_graph_bs=(1,)).output_tok_s
    return predict(LS, cfg, 1, max_running_requests=1, cuda_graph_bs=(1,)).output_tok_s / base


def test_the_tie_threshold_is_the_policy_handed_in() -> None:
    """The model's tie threshold (`risk_z`, from `p_matters`) is read from the policy `choose` is handed (the snapshot's, through
    optimizer.conductor.winner), so a benchmark's --policy varies it."""
    cheap = _c(1, 1, 1, 2, 1.060, 1.034, 1.086)
    best = _c(2, 2, 2, 3, 1.052, 1.027, 1.079)
    model = FakeRanking({_key(cheap): 1.044, _key(best): 1.046}, sure=False, within_sd=2.0)
    assert choose([cheap, best], 0.01, model).winner is cheap  # 2 sd sure: 1.28 (p_matters 0.1) passes
    stricter = DEFAULT_POLICY.with_overrides(["p_matters=0.001"])  # 3.09 sd
    assert choose([cheap, best], 0.01, model, stricter).winner is best
    # Without a model the tie risk decides, and the verdict's note states the risk it was judged by.
    behind = _c(1, 1, 1, 2, 1.030, 1.004, 1.056)
    note = choose([behind, best], 0.01, None, DEFAULT_POLICY.with_overrides(["p_matters=0.05"])).note
    assert note is not None and "a 5% chance or more" in note


def test_ranked_on_every_launch_the_answer_is_within_one_percent_more_often() -> None:
    """Side by side on the same draws: 1% launch noise per start, one search launch per
    configuration and one confirmation per candidate.  The confirmations alone (with the cheaper
    tie) land within 1% of the best about a third of the time; ranked by the study's model, most times."""
    spec = StudySpec.model_validate(
        {"name": "rank", "model": {"target": "t", "draft": "d"}, "workload": {"concurrency": [1]}}
    )
    best = max(_truth(c) for c in SEARCH)
    assert _truth(CANDIDATES[0]) == best and all(_truth(c) < best / 1.01 for c in CANDIDATES[1:])
    rng = random.Random(11)
    draws, plain, ranked = 30, 0, 0
    for d in range(draws):
        trials = []
        for i, cfg in enumerate(SEARCH):
            t = _trial(i, cfg, _levels(rng, cfg, 0.01), _levels(rng, None, 0.01))
            # What the `auto` sampler predicted before the launch, within the noise: the check holds.
            t.user_attrs[A.MODEL_PREDICTION] = {"speedup": _truth(cfg), "log_sd": 0.02}
            trials.append(t)
        docs = []
        for i, cfg in enumerate(CANDIDATES):
            lv, base = _levels(rng, cfg, 0.01), _levels(rng, None, 0.01)
            iv = ratio_interval(lv[0]["output_tok_s_runs"], base[0]["output_tok_s_runs"], extra_var=2 * 0.01**2)
            assert iv is not None
            docs.append(Contender(i, cfg, iv.value, iv))
        rank = ranking.of(spec.model_copy(update={"name": f"rank{d}"}), trials)
        assert rank is not None

        def good(c: Contender) -> bool:
            return _truth(c.config) >= 0.99 * best

        plain += good(choose(docs, spec.budget.min_gain).winner)
        ranked += good(choose(docs, spec.budget.min_gain, rank).winner)
    # Measured on these draws: 11/30 and 24/30 with the model's fixed form alone; 14/30 and 20/30
    # since its residual GP (optimizer/residual_gp.py), whose mean bends towards what was measured
    # nearby, noise included (benchmarks/README.md, "The model's misfit").
    assert ranked >= 0.6 * draws, (plain, ranked)
    assert ranked >= plain + 0.15 * draws, (plain, ranked)


def test_a_model_whose_predictions_missed_or_were_never_checked_does_not_rank() -> None:
    """Where the stop rule's prediction check distrusts the model, or no prediction was made to
    check (another sampler), the confirmations alone rank."""
    rng = random.Random(5)
    trials = []
    for i, cfg in enumerate(SEARCH):
        t = _trial(i, cfg, _levels(rng, cfg, 0.01), _levels(rng, None, 0.01))
        # Each launch predicted 20% off with a confident sd: the check fails.
        t.user_attrs[A.MODEL_PREDICTION] = {"speedup": float(t.value or 1.0) * 1.2, "log_sd": 0.01}
        trials.append(t)
    spec = StudySpec.model_validate(
        {"name": "distrust", "model": {"target": "t", "draft": "d"}, "workload": {"concurrency": [1]}}
    )
    assert ranking.of(spec, trials) is None
    for t in trials:
        t.user_attrs[A.MODEL_PREDICTION] = {"speedup": _truth(A.TrialRecord(t).config), "log_sd": 0.02}
    assert ranking.of(spec.model_copy(update={"name": "checked"}), trials) is not None
    for t in trials:
        del t.user_attrs[A.MODEL_PREDICTION]
    assert ranking.of(spec.model_copy(update={"name": "unchecked"}), trials) is None


# ------------------------------------------------------------------ through the REST API


def test_the_service_answers_the_candidate_its_model_ranks_first_not_the_luckiest_launch(api: Api) -> None:
    """Simulated workers measure every launch by the simulator's model, except that one runner-up's
    confirmation lands 1.2% high (a lucky launch, about the calibrated launch noise).  The study
    document's winner is the truly best confirmed candidate, with its own confirmation's numbers;
    the confirmations alone would have answered the lucky one.  The model reads the confirmations
    too (optimizer.ranking.Relaunch): one launch moves its estimate of that configuration, less than
    the launch moved, as the search launches and the terms it shares with its neighbours hold it.
    (A 4% launch on a runner-up 0.4% behind the best outweighs that, as it should any estimate
    that uses the launch at all.)"""
    landscape = "moe-pcie"
    # A small min_gain: the model judges which runners-up are confirmed (a 10% chance to beat the
    # leader by min_gain), and near-equal candidates must be confirmed for the ranking to matter.
    doc = small_spec(
        "ranked", sampler="auto", seed=3, budget={"max_trials": 12, "min_gain": 0.002}, confirmation={"top": 3}
    )
    assert api.post("/v1/studies", "user", doc).status_code == 201
    base_tok = sim_levels(landscape, None, [1])[0]["output_tok_s"]
    truth_of: dict[str, float] = {}  # every configuration launched, by the simulator's model

    def truth(config: dict[str, Any]) -> float:
        return float(sim_levels(landscape, config, [1])[0]["output_tok_s"]) / float(base_tok)

    best_key: str | None = None
    lucky: str | None = None
    for _ in range(120):  # bounded: the search, its baselines, then the confirmations
        shown = api.get("/v1/studies/ranked", "user").json()
        if shown["state"] != "running":
            break
        if best_key is None and shown["confirmation"]:
            # The candidates are queued together when the search ends: which is truly best is known.
            best_key = max((key_of(c["config"]) for c in shown["confirmation"]), key=lambda k: truth_of[k])
        for w in ("w1", "w2"):
            got = lease(api, w)
            if got is None:
                continue
            if got["kind"] == "baseline":
                body = ok(sim_levels(landscape, None, [1]))
            else:
                truth_of[key_of(got["config"])] = truth(got["config"])
                key = key_of(got["config"])
                if got["kind"] == "confirm" and key != best_key and lucky is None:
                    lucky = key
                luck = 1.012 if got["kind"] == "confirm" and key == lucky else 1.0
                body = ok(sim_levels(landscape, got["config"], [1], scale=luck))
            assert api.post(f"/v1/leases/{got['lease_id']}/complete", "fleet", body).status_code == 200
    shown = api.get("/v1/studies/ranked", "user").json()
    done = [c for c in shown["confirmation"] if c["state"] == "completed"]
    assert shown["state"] == "finished" and len(done) >= 2 and best_key is not None, shown["state"]
    winner = shown["winner"]
    assert key_of(winner["config"]) == best_key, [
        (key_of(c["config"]), truth_of[key_of(c["config"])], c["speedup"], c["search_speedup"], c["worker_id"])
        for c in done
    ]
    mine = next(c for c in done if key_of(c["config"]) == best_key)
    assert winner["speedup"] == pytest.approx(mine["speedup"])  # the numbers are its own launch's
    assert (
        choose([Contender.of_json(c) for c in done], 0.01).winner.config.key != best_key
    )  # one launch each: a lucky one


def test_a_runner_up_the_model_ranks_above_the_leader_is_confirmed() -> None:
    """The leader's one search launch may be its luckiest: a runner-up measured 3% behind (no
    chance to beat it by min_gain on the measurements alone) is confirmed when the trusted model
    puts it first, and only then; it then leads, and the best measured is judged against it."""
    spec = StudySpec.model_validate(
        {"name": "cands", "model": {"target": "t", "draft": "d"}, "workload": {"concurrency": [1]}}
    )

    def lv(tok: float) -> list[dict[str, Any]]:
        runs = [tok * f for f in (0.999, 1.0, 1.001)]
        return [{"concurrency": 1, "output_tok_s": tok, "output_tok_s_runs": runs, "per_user_tok_s": tok,
                 "accept_length": 2.0}]  # fmt: skip

    lead, runner = SEARCH[1], SEARCH[4]
    trials = [_trial(0, lead, lv(105.0), lv(100.0)), _trial(1, runner, lv(102.0), lv(100.0))]
    assert [t.number for t in candidates(trials, 3, spec)] == [0]
    ranks = FakeRanking({lead.key: 1.03, runner.key: 1.04}, sure=False)
    assert [t.number for t in candidates(trials, 3, spec, 0.0, ranks)] == [1]
    close = FakeRanking({lead.key: 1.035, runner.key: 1.04}, sure=False)
    assert [t.number for t in candidates(trials, 1, spec, 0.0, close)] == [1]  # top 1: the model's first
    behind = FakeRanking({lead.key: 1.04, runner.key: 1.03}, sure=False)
    assert [t.number for t in candidates(trials, 3, spec, 0.0, behind)] == [0]


def _on(t: FrozenTrial, host: str) -> FrozenTrial:
    t.user_attrs[A.WORKER_ID] = host
    return t


def test_the_confirmations_let_the_model_take_a_hosts_offset_out_of_its_ranking() -> None:
    """Host h1 runs speculative cycles 6% slower than its baseline says (an offset the family of
    drawn engines has: benchmarks/family.py).  The true best (2/2/3) was found on h1, so its search
    launch reads 6% low; its two runners-up were found on h0.  Each is confirmed on the other host
    (optimizer.conductor.candidates), so every candidate stands on both.  Side by side on the same
    draws: the model fitted to the search alone ranks a runner-up first every time; with the
    confirmations as its data (optimizer.ranking.Relaunch) it sees part of h1's offset and ranks
    the best first in a good share of them (measured: 0/12 and 5/12; the residual GP's host
    offsets are shrunk towards its prior, optimizer.policy `residual_host_sds`)."""
    spec = StudySpec.model_validate(
        {"name": "offset", "model": {"target": "t", "draft": "d"}, "workload": {"concurrency": [1]}}
    )
    slow = {"h1": 1.06}
    found_on = {c.key: "h0" for c in SEARCH} | {CANDIDATES[0].key: "h1"} | {SEARCH[3].key: "h1", SEARCH[7].key: "h1"}

    def launch(rng: random.Random, cfg: SpecConfig, host: str) -> tuple[list[Any], list[Any]]:
        lv = _levels(rng, cfg, 0.005)
        for x in lv:
            x["output_tok_s"] /= slow.get(host, 1.0)
            x["per_user_tok_s"] /= slow.get(host, 1.0)
            x["output_tok_s_runs"] = [r / slow.get(host, 1.0) for r in x["output_tok_s_runs"]]
        return lv, _levels(rng, None, 0.005)

    rng = random.Random(3)
    draws, alone, with_confirmations = 12, 0, 0
    for d in range(draws):
        trials = []
        for i, cfg in enumerate(SEARCH):
            t = _on(_trial(i, cfg, *launch(rng, cfg, found_on[cfg.key])), found_on[cfg.key])
            t.user_attrs[A.MODEL_PREDICTION] = {"speedup": float(t.value or 1.0), "log_sd": 0.03}
            trials.append(t)
        other = {"h0": "h1", "h1": "h0"}
        relaunches = [
            ranking.Relaunch(cfg, *launch(rng, cfg, other[found_on[cfg.key]]), other[found_on[cfg.key]])
            for cfg in CANDIDATES
        ]
        plain = ranking.of(spec.model_copy(update={"name": f"alone{d}"}), trials)
        pooled = ranking.of(spec.model_copy(update={"name": f"pooled{d}"}), trials, relaunches=relaunches)
        assert plain is not None and pooled is not None
        alone += max(CANDIDATES, key=plain.estimate) == CANDIDATES[0]
        with_confirmations += max(CANDIDATES, key=pooled.estimate) == CANDIDATES[0]
    assert with_confirmations >= alone + draws // 3, (alone, with_confirmations)
