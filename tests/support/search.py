"""Drive the REST API as simulated workers would: measurements from the simulator's model.

The metrics a worker reports are computed with `spectune_sim.model.predict` for the
configuration leased, with a small fixed spread over the repeated passes, so tests can reason
about which configuration wins and by how much.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from optuna.distributions import IntDistribution
from optuna.trial import FrozenTrial, create_trial

from optimizer.objective import CONSTRAINT_KEY
from optimizer.space import SpecConfig
from optimizer.verify_probe import ProbePlan, probe_levels
from spectune_sim.landscapes import LANDSCAPES
from spectune_sim.model import extend_ms, predict
from tests.support.api_client import Api
from tests.support.specs import INVENTORY

SPREAD = (0.996, 1.0, 1.004)


def sim_levels(landscape: str, config: dict[str, Any] | None, levels: Sequence[int], scale: float = 1.0) -> list[Any]:
    ls = LANDSCAPES[landscape]
    cfg = None if config is None else SpecConfig.model_validate(config)
    out = []
    for c in levels:
        p = predict(ls, cfg, c, max_running_requests=max(levels), cuda_graph_bs=tuple(levels))
        tok = p.output_tok_s * scale
        out.append(
            {
                "concurrency": c,
                "output_tok_s": tok,
                "output_tok_s_runs": [tok * f for f in SPREAD],
                "per_user_tok_s": tok / p.batch_size,
                "accept_length": p.accept_length if cfg is not None else None,
                "itl_ms_p99": p.cycle_ms,
            }
        )
    return out


def sim_probe(landscape: str, levels: Sequence[int]) -> dict[str, Any]:
    """The verify probe a worker reports with its baseline (workers/loadgen/probe.py's plan), timed
    on the simulator's extend forward with SPREAD over the repeats: the same in every run."""
    plan = ProbePlan(levels=probe_levels(levels, max(levels)))
    points = []
    for b, k in plan.batches():
        runs = [extend_ms(LANDSCAPES[landscape], b * k, speculative=False) / 1000.0 * f for f in SPREAD]
        points.append({"concurrency": b, "tokens": k, "seconds": runs[1], "seconds_runs": runs})
    return {
        "points": points,
        "prefix_tokens": plan.prefix_tokens,
        "cached_share": 1.0,
        "spent_s": sum(sum(p["seconds_runs"]) for p in points),
    }


def trial_attrs(
    landscape: str, config: SpecConfig, levels: Sequence[int], *, startup_s: float | None = None
) -> dict[str, Any]:
    """A measured trial's user attributes as the service stores them, measured on the simulator."""
    lv = sim_levels(landscape, config.model_dump(mode="json"), levels)
    base = sim_levels(landscape, None, levels)
    by_level = {str(a["concurrency"]): a["output_tok_s"] / b["output_tok_s"] for a, b in zip(lv, base, strict=True)}
    attrs = {
        "config": config.model_dump(mode="json"),
        "config_key": config.key,
        "levels": lv,
        "baseline_levels": base,
        "speedup_by_level": by_level,
    }
    return attrs if startup_s is None else {**attrs, "startup_s": startup_s}


def frozen_trial(number: int, value: float, attrs: dict[str, Any], violation: float = 0.0) -> FrozenTrial:
    """A finished trial as Optuna hands it to the samplers and the stop rules."""
    t = create_trial(
        value=value,
        params={"num_steps": 1},
        distributions={"num_steps": IntDistribution(1, 10)},
        user_attrs=attrs,
    )
    t.number = number
    t.set_constraint(CONSTRAINT_KEY, violation)
    return t


def ok(levels: list[Any], verify_probe: dict[str, Any] | None = None) -> dict[str, Any]:
    metrics = {"levels": levels, "startup_s": 12.0, "sglang_version": "0.5.23"}
    return {"outcome": "ok", "metrics": metrics if verify_probe is None else {**metrics, "verify_probe": verify_probe}}


OOM = {"outcome": "failed", "failure": {"kind": "oom", "message": "CUDA out of memory during graph capture"}}


def lease(api: Api, worker: str, inventory: dict[str, Any] | None = None) -> dict[str, Any] | None:
    r = api.post(f"/v1/workers/{worker}/lease", "fleet", inventory or INVENTORY)
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def drive(
    api: Api,
    study: str,
    workers: Sequence[str],
    landscape: str,
    *,
    oom_keys: Collection[str] = (),
    max_rounds: int = 120,
    inventory: dict[str, Any] | None = None,
    probe: bool = False,
) -> list[dict[str, Any]]:
    """Lease and complete round-robin until the study leaves `running`; returns every lease handed
    out.  `probe`: each baseline reports the verify probe (`sim_probe`), as today's workers do."""
    handed: list[dict[str, Any]] = []
    for _ in range(max_rounds):
        if api.get(f"/v1/studies/{study}", "user").json()["state"] != "running":
            return handed
        for w in workers:
            got = lease(api, w, inventory)
            if got is None:
                continue
            handed.append(got)
            levels = got["workload"]["concurrency"]
            if got["kind"] == "baseline":
                body = ok(sim_levels(landscape, None, levels), sim_probe(landscape, levels) if probe else None)
            elif SpecConfig.model_validate(got["config"]).key in oom_keys:
                body = OOM
            else:
                body = ok(sim_levels(landscape, got["config"], levels))
            r = api.post(f"/v1/leases/{got['lease_id']}/complete", "fleet", body)
            assert r.status_code == 200, r.text
    raise AssertionError(f"study {study} still running after {max_rounds} rounds")


def key_of(config: dict[str, Any]) -> str:
    return SpecConfig.model_validate(config).key
