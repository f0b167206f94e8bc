"""The adaptive answer's launch (issue 17 items 1, 3): the conductor queues it, the study
document reads what became of it (api/services/adaptive_answer.py)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from optuna.trial import FrozenTrial

from api.documents import Confirmation, StudyDocument, TrialRow
from api.models import LeaseRow
from api.report.export import to_csv, to_json
from api.report.tables import study_summary
from api.services.adaptive_answer import outcome
from api.services.lease_rows import ConfirmInfo, lease_payload
from api.services.studies import _confirmations
from optimizer import answer, convergence, deploy
from optimizer import attrs as A
from optimizer import conductor as c
from optimizer.space import SpecConfig
from optimizer.study_state import Ending, FinishReason, Phase
from tests.api.test_printed_command import _printed
from tests.optimizer.test_conductor import BASES, T0, _settled, finished, snap, spec_of
from tests.support.api_client import Api
from tests.support.search import OOM, lease, ok, sim_levels
from tests.support.specs import INVENTORY, split_load_spec

CHAIN = SpecConfig(num_steps=2, topk=1, num_draft_tokens=3)
OTHER = SpecConfig(num_steps=1, topk=1, num_draft_tokens=2)


def _levels(by_level: dict[int, float]) -> list[dict[str, Any]]:
    return [
        {"concurrency": lv, "output_tok_s": 100 * v, "output_tok_s_runs": [100 * v * f for f in (0.999, 1.0, 1.001)]}
        for lv, v in by_level.items()
    ]


def split(number: int, config: SpecConfig, by_level: dict[int, float]) -> FrozenTrial:
    """A chain that pays alone and loses at 4 (geometric mean below 1)."""
    return finished(
        number,
        (by_level[1] * by_level[4]) ** 0.5,
        {
            A.CONFIG: config.model_dump(mode="json"),
            A.CONFIG_KEY: config.key,
            A.WORKER_ID: "w1",
            A.SPEEDUP_BY_LEVEL: {str(k): v for k, v in by_level.items()},
            A.LEVELS: _levels(by_level),
            A.BASELINE_LEVELS: _levels({1: 1.0, 4: 1.0}),
        },
    )


TRIALS = [split(0, CHAIN, {1: 1.6, 4: 0.5}), split(1, OTHER, {1: 1.3, 4: 0.6})]
SPEC: dict[str, Any] = {"workload": {"concurrency": [1, 4]}, "budget": {"max_trials": 30}}


def test_a_search_that_does_not_pay_over_both_levels_launches_the_adaptive_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = spec_of("adaptive-nopay", **SPEC)
    monkeypatch.setattr(convergence, "assess", lambda spec, trials, *_: _settled(False))
    action = c.settle(snap(spec, TRIALS, baselines=BASES))
    # "Does not pay" over both levels, but the chain pays alone: its adaptive server is launched.
    assert isinstance(action, c.StartConfirmation), action
    assert action.ending.reason == FinishReason.DOES_NOT_PAY
    (proof,) = action.candidates
    assert proof.adaptive and proof.trial_number is None and proof.envelope is not None
    server = proof.envelope.settings
    assert server.adaptive is not None and server.adaptive.steps_by_batch == {1: 2, 4: 0}
    assert server.speculative == CHAIN and server.max_running_requests == 4
    # Exactly the printed server: the planned deployment's settings.
    planned = deploy.adaptive_plan(
        spec, answer.adaptive_export(spec, TRIALS, c.launch_noise(snap(spec, TRIALS)).variance)
    )
    assert planned == server


def test_with_candidates_to_confirm_the_adaptive_proof_comes_last(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_of("adaptive-pays", **SPEC, confirmation={"top": 2})
    monkeypatch.setattr(convergence, "assess", lambda spec, trials, *_: _settled(True))
    action = c.settle(snap(spec, TRIALS, baselines=BASES))
    assert isinstance(action, c.StartConfirmation)
    assert [x.adaptive for x in action.candidates][-1] is True
    assert all(not x.adaptive for x in action.candidates[:-1]) and action.candidates[:-1]
    # Queued together, the adaptive one (no trial number) is handed out after the candidates.
    queued = [
        c.LeaseView(f"l{i}", "confirm", "queued", trial_number=x.trial_number, created_at=T0)
        for i, x in enumerate(reversed(action.candidates))
    ]
    confirming = snap(
        spec, TRIALS, baselines=(*BASES, c.Baseline(9, "w2", T0 + timedelta(minutes=1), {1: 100.0, 4: 100.0})),
        leases=queued, phase=Phase.CONFIRMATION, confirmation_began_at=T0, now=T0 + timedelta(minutes=2),
    )  # fmt: skip
    first = c.next_action(confirming, "w2")
    assert isinstance(first, c.Confirm) and first.lease_id != "l0", first


def test_no_adaptive_answer_no_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_of("adaptive-none", **SPEC)
    monkeypatch.setattr(convergence, "assess", lambda spec, trials, *_: _settled(False))
    losing = [split(0, CHAIN, {1: 0.9, 4: 0.5})]
    # A study that confirms nothing (confirmation.top 0) launches no proof either.
    unconfirmed = spec_of("adaptive-top0", **SPEC, confirmation={"top": 0})
    assert isinstance(c.settle(snap(unconfirmed, TRIALS, baselines=BASES)), c.Finish)
    assert c.settle(snap(spec, losing, baselines=BASES)) == c.Finish(
        Ending(FinishReason.DOES_NOT_PAY, "the rule's words")
    )


def _row(state: str, id_: str = "a1", **kw: Any) -> LeaseRow:
    # Stored as the service stores an adaptive proof's payload (api/services/lease_rows.py).
    proof = lease_payload(spec_of("adaptive-doc", **SPEC), None, confirm=ConfirmInfo(adaptive=True))
    return LeaseRow(id=id_, state=state, kind="confirm", payload=proof.doc(), attempt=1, **kw)


def _record(rows: list[LeaseRow]) -> Confirmation | None:
    """The adaptive launch's entry of the document's confirmations, as the study document builds it."""
    return next((c for c in _confirmations(spec_of("adaptive-doc", **SPEC), rows) if c.adaptive), None)


def test_the_document_reads_the_launch_pending_failed_or_proven() -> None:
    spec = spec_of("adaptive-doc", **SPEC)
    planned = deploy.plan_deployment(
        spec, CHAIN, pays=False, exported=answer.adaptive_export(spec, TRIALS), version="0.5.23"
    )
    assert planned is not None and planned.mode == "adaptive"
    assert outcome(spec, planned, [], [], None, "0.5.23") == type(outcome(spec, planned, [], [], None, "0.5.23"))()
    pending = outcome(spec, planned, [_row("queued")], [], _record([_row("queued")]), "0.5.23")
    assert pending.pending is not None and "a1" in pending.pending and pending.proven is None
    failed = outcome(
        spec, planned, [_row("failed")], ["the adaptive deployment did not start (out of GPU memory at start-up)"],
        _record([_row("failed")]), "0.5.23",
    )  # fmt: skip
    assert failed.fallback is not None and "out of GPU memory" in failed.fallback and "falls back" in failed.fallback
    server = planned.settings.model_dump(mode="json")
    done = _row(
        "completed",
        "a2",
        worker_id="w2",
        speedup=(1.55 * 0.99) ** 0.5,  # what completing the lease stores (the objective)
        result={
            "metrics": {"levels": _levels({1: 1.55, 4: 0.99}), "sglang_version": "0.5.23"},
            "confirmation": {"baseline_levels": _levels({1: 1.0, 4: 1.0})},
            "deployment": {"server": server, "adaptive": True},
        },
    )
    rows = [_row("failed"), done]
    proven = outcome(spec, planned, rows, [], _record(rows), "0.5.23")
    assert proven.proven is not None and proven.proven.proven_by == "a2"
    assert proven.proven.command() == planned.command(), "the proven command is the printed one"
    assert proven.verdict is not None and "lease a2 on w2" in proven.verdict
    assert "1: 1.550x" in proven.verdict and "4: 0.990x" in proven.verdict


def _adaptive_levels(server: dict[str, Any], config: dict[str, Any], levels: list[int]) -> list[Any]:
    """The adaptive server as the simulated engine measures it: its chain where its steps are
    above 0, the server without speculation where they are 0."""
    steps = {int(k): v for k, v in server["adaptive"]["steps_by_batch"].items()}
    return [sim_levels("split-load", config if steps.get(c, 0) > 0 else None, [c])[0] for c in levels]


def test_the_proven_adaptive_launch_is_best_on_every_surface(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 17 item 5: one result, one number.  Through the REST API, a study on the split-load
    engine (a chain pays alone, everything loses from 4 running requests on) answers SGLang's
    adaptive server; its launch is `best` and `winner` (speedup, interval, levels, host, lease),
    every renderer prints that record, the CSV export carries its confirmation rows, and the
    static winner is shown only as the best static configuration."""
    name = "adaptive-one-record"
    _split_load_study(api, name)
    shown = api.get(f"/v1/studies/{name}", "user").json()
    assert shown["state"] == "finished", shown["finish_reason"]
    dep = shown["deployment"]
    assert dep["mode"] == "adaptive" and dep["proven_by"], shown["verdict"]
    (proof,) = [c for c in shown["confirmation"] if c["adaptive"]]
    assert proof["trial_number"] is None and proof["state"] == "completed" and proof["lease_id"] == dep["proven_by"]
    best = shown["best"]
    # One record: best is the winner is the adaptive launch, its numbers, host and lease.
    assert best == shown["winner"] and best["adaptive"] is True
    assert best["lease_id"] == proof["lease_id"] and best["worker_id"] == best["confirmed_on"] == proof["worker_id"]
    assert best["speedup"] == proof["speedup"] and best["speedup_interval"] == proof["speedup_interval"]
    assert best["speedup_by_level"] == proof["speedup_by_level"] and best["levels"] == proof["levels"]
    assert best["server"] == dep["server"] and best["launch_command"] == dep["launch_command"]
    assert best["steps_by_batch"] == {"1": dep["adaptive_config"]["1"]["candidate_steps"][0], "4": 0}
    # The static winner is what it is: the best static configuration, not the answer.
    static = shown["best_static"]
    assert static is not None and static["adaptive"] is False and static["lease_id"] != best["lease_id"]
    number = f"{best['speedup']:.3f}x"
    assert number in shown["verdict"] and best["lease_id"] in shown["verdict"] and best["worker_id"] in shown["verdict"]
    document = StudyDocument.model_validate(shown)
    summary = study_summary(document)
    (best_line,) = [line for line in summary.splitlines() if line.startswith("best ")]
    assert "adaptive server" in best_line and number in best_line, summary
    assert f"lease {best['lease_id']} on {best['worker_id']}" in summary
    assert "the best static configuration" in summary and f"{static['speedup']:.3f}x" in summary
    texts = _printed(document, capsys)
    for where, text in texts.items():
        assert f"{best['speedup']:.3f}" in text and best["lease_id"] in text, (where, text)
        assert "the best static configuration" in text, where
    # The CSV export: the adaptive launch's confirmation rows, at each level, with its numbers.
    trials = [TrialRow.model_validate(t) for t in api.get(f"/v1/studies/{name}/trials", "user").json()]
    rows = list(csv.DictReader(io.StringIO(to_csv(name, trials, document.confirmation))))
    mine = [r for r in rows if r["source"] == "adaptive confirmation"]
    assert [int(r["concurrency"]) for r in mine] == [1, 4], rows
    assert all(float(r["objective_speedup"]) == best["speedup"] and r["worker_id"] == best["worker_id"] for r in mine)
    assert {r["concurrency"]: float(r["speedup"]) for r in mine} == {k: v for k, v in best["speedup_by_level"].items()}
    # The JSON export is the document: the same best.
    assert json.loads(to_json(document, trials))["study"]["best"] == best


def _split_load_study(
    api: Api,
    name: str,
    *,
    adaptive_starts: Callable[[dict[str, Any]], bool] = lambda server: True,
    adaptive_report: Callable[[list[Any]], list[Any]] = lambda levels: levels,
) -> list[Any]:
    """A study on split-load driven to its end through the REST API; the adaptive server's launch
    is measured as the simulated engine would run it, or runs out of memory at start-up where
    `adaptive_starts` (given the leased server) says it does not.  Returns the adaptive leases."""
    spec = split_load_spec(name, output_len=32)
    assert api.post("/v1/studies", "user", spec).status_code == 201
    inventory = INVENTORY | {"models": ["split-load", "split-load-eagle3"]}
    handed: list[Any] = []
    for _ in range(60):  # bounded: two trials, their baselines, two confirmations
        if api.get(f"/v1/studies/{name}", "user").json()["state"] != "running":
            return handed
        for w in ("w1", "w2"):
            got = lease(api, w, inventory)
            if got is None:
                continue
            levels = got["workload"]["concurrency"]
            if got["server"].get("adaptive"):
                handed.append(got)
                starts = adaptive_starts(got["server"])
                measured = adaptive_report(_adaptive_levels(got["server"], got["config"], levels))
                body = ok(measured) if starts else OOM
            else:
                body = ok(sim_levels("split-load", got["config"] if got["kind"] != "baseline" else None, levels))
            assert api.post(f"/v1/leases/{got['lease_id']}/complete", "fleet", body).status_code == 200
    raise AssertionError("the study did not finish")


def test_the_adaptive_proof_is_not_judged_by_its_initial_chain(api: Api) -> None:
    """CI on 4dd6983: at 4 running requests the adaptive server drafts nothing (steps 0), but one
    cycle of the chain ran while a request was alone, so the level reported 96 tokens over one
    verify: an accept length of 96 that no static 2-step chain allows.  The report was quarantined
    as implausible and the answer fell back to no speculation.  The engine chooses the adaptive
    server's chain per batch; its report is scored as measured."""

    def one_verify_at_4(levels: list[Any]) -> list[Any]:
        return [lv | {"accept_length": 96.0} if lv["concurrency"] == 4 else lv for lv in levels]

    name = "adaptive-one-verify"
    _split_load_study(api, name, adaptive_report=one_verify_at_4)
    shown = api.get(f"/v1/studies/{name}", "user").json()
    (proof,) = [c for c in shown["confirmation"] if c["adaptive"]]
    assert proof["state"] == "completed", proof
    assert shown["deployment"]["mode"] == "adaptive" and shown["best"]["adaptive"] is True, shown["verdict"]


def test_a_failed_adaptive_launch_leaves_the_static_answer_as_best_and_says_so(api: Api) -> None:
    """The adaptive server ran out of memory: `best` is the static answer (no `best_static`), the
    verdict says the adaptive deployment did not start, and its failed launch is in the export."""
    name = "adaptive-oom"
    handed = _split_load_study(api, name, adaptive_starts=lambda server: False)
    # The printed server, then the same server with graphs only for the measured batch sizes:
    # every graph envelope the serving section leaves was tried before the answer fell back.
    assert [h["server"]["cuda_graph_bs"] for h in handed] == [None, [1, 4]]
    shown = api.get(f"/v1/studies/{name}", "user").json()
    assert shown["state"] == "finished", shown["finish_reason"]
    assert shown["deployment"]["mode"] != "adaptive" and shown["verdict"].startswith(
        "the adaptive deployment did not start"
    ), shown["verdict"]
    (proof,) = [c for c in shown["confirmation"] if c["adaptive"]]
    assert proof["state"] == "failed" and proof["speedup"] is None
    assert shown["best"] == shown["winner"] and not shown["best"]["adaptive"] and shown["best_static"] is None
    document = StudyDocument.model_validate(shown)
    assert "the best static configuration" not in study_summary(document)
    rows = list(csv.DictReader(io.StringIO(to_csv(name, [], document.confirmation))))
    assert [r["state"] for r in rows if r["source"] == "adaptive confirmation"] == ["confirmation failed"]


def test_an_adaptive_server_that_runs_out_of_memory_is_proven_with_smaller_graphs(api: Api) -> None:
    """Issue 17 item 2 for the adaptive answer: its printed server runs out of memory capturing
    CUDA graphs up to batch 4; the same server with graphs only for the measured batch sizes
    starts, and that launch is the answer, printed as it started and saying why."""
    name = "adaptive-smaller"
    handed = _split_load_study(api, name, adaptive_starts=lambda server: server["cuda_graph_bs"] is not None)
    first, second = handed
    assert first["server"]["cuda_graph_bs"] is None and second["server"]["cuda_graph_bs"] == [1, 4]
    # Only the graphs changed: the load it serves and the adaptive steps are the printed ones.
    assert {k: v for k, v in second["server"].items() if k != "cuda_graph_bs"} == {
        k: v for k, v in first["server"].items() if k != "cuda_graph_bs"
    }
    shown = api.get(f"/v1/studies/{name}", "user").json()
    assert shown["state"] == "finished", shown["finish_reason"]
    dep = shown["deployment"]
    assert dep["mode"] == "adaptive" and dep["proven_by"] == second["lease_id"], shown["verdict"]
    assert dep["server"] == second["server"] and "--cuda-graph-bs-decode 1 4" in dep["launch_command"]
    assert "did not start" in dep["reason"] and "measured batch sizes 1, 4" in dep["reason"]
    assert shown["best"]["lease_id"] == second["lease_id"] and shown["best"]["adaptive"] is True
    assert not shown["verdict"].startswith("the adaptive deployment did not start"), shown["verdict"]
