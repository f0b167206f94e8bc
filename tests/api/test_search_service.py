"""Restarts never spent twice or in vain, pruning, and a fleet's starts predicted in flight,
through the REST API on both backends."""

from __future__ import annotations

from collections import Counter
from typing import Any

from optimizer import convergence
from tests.support.api_client import Api
from tests.support.search import OOM, drive, key_of, lease, ok, sim_levels
from tests.support.specs import small_spec

TINY = {"num_steps": {"low": 1, "high": 3}, "topk": [1, 2], "num_draft_tokens": {"low": 2, "high": 3}}


def test_no_configuration_is_launched_twice(api: Api) -> None:
    # Random search over a 5-configuration space (2/2/2 is dominated by 1/2/2 and left out) with a
    # budget of 20 proposes duplicates; every one must be answered from the earlier measurement,
    # never launched again.
    space = {"num_steps": {"low": 1, "high": 2}, "topk": [1, 2], "num_draft_tokens": {"low": 2, "high": 3}}
    spec = small_spec("nodup", search_space=space, sampler="random", budget={"max_trials": 20})
    spec["confirmation"] = {"top": 0}
    assert api.post("/v1/studies", "user", spec).status_code == 201
    handed = drive(api, "nodup", ["w1"], "moe-pcie")

    launched = [key_of(le["config"]) for le in handed if le["kind"] == "trial"]
    assert len(launched) == 5 and len(set(launched)) == 5, Counter(launched)
    shown = api.get("/v1/studies/nodup", "user").json()
    assert shown["state"] == "finished" and shown["configurations_launched"] == 5
    assert shown["trials"]["COMPLETE"] > 5  # duplicates were proposed, and answered without a launch
    assert "every valid configuration" in shown["finish_reason"]
    trials = api.get("/v1/studies/nodup/trials", "user").json()
    for t in trials:
        if t["duplicate_of"] is not None:
            # A duplicate carries the value of the trial it repeats, and had no lease.
            first = next(x for x in trials if x["number"] == t["duplicate_of"])
            assert t["speedup"] == first["speedup"]
            assert t["number"] not in {le["trial_number"] for le in handed}


def test_a_known_oom_region_is_skipped_without_a_launch(api: Api) -> None:
    # The grid walks every configuration in order; 1/2/2 runs out of memory, so every tree with at
    # least 1 step, topk 2 and 2 draft tokens would too: none of them may be launched.
    spec = small_spec("oomgrid", search_space=TINY, sampler="grid", budget={"max_trials": 20})
    spec["confirmation"] = {"top": 0}
    api.post("/v1/studies", "user", spec)
    handed = drive(api, "oomgrid", ["w1"], "moe-pcie", oom_keys={"s1-k2-n2-bsauto"})

    launched = [key_of(le["config"]) for le in handed if le["kind"] == "trial"]
    assert sorted(launched) == sorted(["s1-k1-n2-bsauto", "s1-k2-n2-bsauto", "s2-k1-n3-bsauto", "s3-k1-n4-bsauto"])
    trials = api.get("/v1/studies/oomgrid/trials", "user").json()
    oom = next(t for t in trials if t["config"] and key_of(t["config"]) == "s1-k2-n2-bsauto")
    inferred = [t for t in trials if t["state"] == "COMPLETE" and t["failure_kind"] == "oom" and t is not oom]
    # The grid asked for these before its last chain (2/2/2, 3/2/2 and 3/2/3 are dominated
    # trees, outside the space).
    assert {key_of(t["config"]) for t in inferred} == {"s1-k2-n3-bsauto", "s2-k2-n3-bsauto"}
    for t in inferred:
        assert t["feasible"] is False and t["inferred_from"] == oom["number"]
        assert f"trial {oom['number']}" in t["failure_message"]
    full = {t["number"]: t for t in api.get("/v1/studies/oomgrid/trials", "user").json()}
    assert all(full[t["number"]]["speedup"] is not None for t in inferred)
    shown = api.get("/v1/studies/oomgrid", "user").json()
    assert shown["configurations_launched"] == 4
    assert shown["state"] == "finished" and "known to run out of memory" in shown["finish_reason"]


def test_a_trial_clearly_worse_after_its_first_level_is_pruned(api: Api) -> None:
    spec = small_spec("prune", workload={"output_len": 32, "num_prompts": 4, "concurrency": [1, 4], "repeats": 3})
    spec["confirmation"] = {"top": 0}
    api.post("/v1/studies", "user", spec)
    base = lease(api, "w1")
    assert base is not None and base["kind"] == "baseline"
    api.post(f"/v1/leases/{base['lease_id']}/complete", "fleet", ok(sim_levels("moe-pcie", None, [1, 4])))

    # First trial (SGLang's 3/1/4): measured in full.
    first = lease(api, "w1")
    assert first is not None and first["kind"] == "trial"
    levels = sim_levels("moe-pcie", first["config"], [1, 4])
    r = api.post(f"/v1/leases/{first['lease_id']}/progress", "fleet", _progress(0, levels[0]))
    assert r.json()["action"] == "continue"  # nothing to compare with yet
    api.post(f"/v1/leases/{first['lease_id']}/complete", "fleet", ok(levels))

    # Second trial: as fast as the first at level 1 -> continue (within the noise).
    second = lease(api, "w1")
    assert second is not None
    close = sim_levels("moe-pcie", first["config"], [1, 4], scale=0.99)
    r = api.post(f"/v1/leases/{second['lease_id']}/progress", "fleet", _progress(0, close[0]))
    assert r.json()["action"] == "continue"
    api.post(f"/v1/leases/{second['lease_id']}/complete", "fleet", ok(close))

    # Third trial: half as fast at level 1; even matching the best at level 4 it cannot win.
    third = lease(api, "w1")
    assert third is not None
    slow = sim_levels("moe-pcie", first["config"], [1, 4], scale=0.5)
    r = api.post(f"/v1/leases/{third['lease_id']}/progress", "fleet", _progress(0, slow[0]))
    assert r.json()["action"] == "prune"
    # The worker stops and reports the level it measured.
    r = api.post(f"/v1/leases/{third['lease_id']}/complete", "fleet", ok(slow[:1]))
    assert r.status_code == 200 and r.json()["speedup"] is None

    trials = {t["number"]: t for t in api.get("/v1/studies/prune/trials", "user").json()}
    pruned = trials[third["trial_number"]]
    assert pruned["state"] == "PRUNED" and "below the best" in pruned["pruned"]["reason"]
    assert pruned["partial_speedup_by_level"]["1"] < 0.6
    assert trials[second["trial_number"]]["state"] == "COMPLETE"
    shown = api.get("/v1/studies/prune", "user").json()
    assert shown["best"]["trial_number"] == first["trial_number"]
    # A pruned configuration counts as launched and is never launched again.
    assert shown["configurations_launched"] == 3

    # Once an admin quarantines every measured trial, nothing is left to prune against: the same
    # slow first level continues.
    from api.services.trial_records import repair_trial

    ctx = api.client.app.state.ctx  # type: ignore[attr-defined]
    for number in (first["trial_number"], second["trial_number"]):
        repair_trial(ctx.write_sessions, "prune", number, quarantine="forged measurement")
    fourth = lease(api, "w1")
    assert fourth is not None and fourth["kind"] == "trial"
    r = api.post(f"/v1/leases/{fourth['lease_id']}/progress", "fleet", _progress(0, slow[0]))
    assert r.json()["action"] == "continue", r.json()


def test_oom_report_then_same_region_from_tpe_is_not_relaunched(api: Api) -> None:
    # The same inference with a sampler that keeps proposing large trees (TPE, seeded).
    spec = small_spec("oomtpe", sampler="tpe", budget={"max_trials": 6})
    spec["confirmation"] = {"top": 0}
    spec["warm_start"] = [{"num_steps": 1, "topk": 2, "num_draft_tokens": 2}]
    api.post("/v1/studies", "user", spec)
    handed = drive(api, "oomtpe", ["w1"], "moe-pcie", oom_keys={"s1-k2-n2-bsauto"})
    trees = [le for le in handed if le["kind"] == "trial" and le["config"]["topk"] > 1]
    # Only the failing tree itself was launched: every tree needs at least its memory.
    assert [key_of(le["config"]) for le in trees] == ["s1-k2-n2-bsauto"]
    assert OOM["failure"]["kind"] == "oom"


def _progress(step: int, level: dict[str, object]) -> dict[str, object]:
    return {"step": step, "concurrency": level["concurrency"], "output_tok_s": level["output_tok_s"]}


def test_a_quarantined_result_is_not_copied_into_its_duplicates(api: Api) -> None:
    """A proposal of a configuration whose trial an admin quarantined is not answered with the
    quarantined measurement (that would bring it back under a new number)."""
    from api.services.trial_records import repair_trial

    space = {"num_steps": {"low": 1, "high": 2}, "topk": [1, 2], "num_draft_tokens": {"low": 2, "high": 3}}
    spec = small_spec("dupq", search_space=space, sampler="random", budget={"max_trials": 30})
    spec["confirmation"] = {"top": 0}
    assert api.post("/v1/studies", "user", spec).status_code == 201
    base = lease(api, "w1")
    assert base is not None and base["kind"] == "baseline"
    api.post(f"/v1/leases/{base['lease_id']}/complete", "fleet", ok(sim_levels("moe-pcie", None, [1])))
    first = lease(api, "w1")
    assert first is not None and first["kind"] == "trial"
    api.post(f"/v1/leases/{first['lease_id']}/complete", "fleet", ok(sim_levels("moe-pcie", first["config"], [1])))
    ctx = api.client.app.state.ctx  # type: ignore[attr-defined]
    repair_trial(ctx.write_sessions, "dupq", first["trial_number"], quarantine="forged measurement")
    drive(api, "dupq", ["w1"], "moe-pcie")

    trials = api.get("/v1/studies/dupq/trials", "user").json()
    copies = [t for t in trials if t["duplicate_of"] == first["trial_number"]]
    assert copies, "the sampler never proposed the quarantined configuration again"
    for t in copies:
        assert t["state"] == "FAIL" and t["speedup"] is None and "quarantined" in t["failure_message"], t
    shown = api.get("/v1/studies/dupq", "user").json()
    assert shown["best"] is None or shown["best"]["trial_number"] not in {first["trial_number"]} | {
        t["number"] for t in copies
    }


def test_a_fleets_starts_get_predictions_in_flight_through_the_service(api: Api) -> None:
    """Four workers lease before any result is in: as many starting points fly as the model rule
    needs (MIN_MEASURED), with no prediction, and the fourth worker waits.  As their results come
    in one by one, those still in flight get the model's prediction (move "start", from the
    results before them); the trial rows show it, and the prediction check then counts them."""
    spec = small_spec("fleet-starts", budget={"max_trials": 12})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    workers = ["w1", "w2", "w3", "w4"]
    for w in workers:
        got = lease(api, w)
        assert got is not None and got["kind"] == "baseline"
        levels = got["workload"]["concurrency"]
        r = api.post(f"/v1/leases/{got['lease_id']}/complete", "fleet", ok(sim_levels("moe-pcie", None, levels)))
        assert r.status_code == 200, r.text
    asked = [lease(api, w) for w in workers]
    starts = [s for s in asked if s is not None]
    assert len(starts) == convergence.MIN_MEASURED < len(workers), asked
    assert all(s["kind"] == "trial" for s in starts), starts

    def rows() -> dict[int, dict[str, Any]]:
        return {t["number"]: t for t in api.get("/v1/studies/fleet-starts/trials", "user").json()}

    assert all(t["model_prediction"] is None for t in rows().values())
    for s in starts:
        assert s is not None
        body = ok(sim_levels("moe-pcie", s["config"], s["workload"]["concurrency"]))
        assert api.post(f"/v1/leases/{s['lease_id']}/complete", "fleet", body).status_code == 200
    shown = rows()
    made = [shown[s["trial_number"]]["model_prediction"] for s in starts if s is not None]
    # The first result comes in with no model to predict from; the second is not predicted as it
    # arrives, but the two still in flight are, then, from the first result alone.
    assert made[:2] == [None, None]
    assert len(made) > 2
    for m in made[2:]:
        assert m is not None and m["move"] == "start" and m["observations"] == 1 and m["p_oom"] is None, m
