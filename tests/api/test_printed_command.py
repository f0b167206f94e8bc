"""The printed command is the measured command (issue 17 items 1, 2, 5), through the REST API.

Simulated workers start each lease's server exactly as leased: a server the simulator's memory
model says does not fit (the deploy-tight engine: the tuning envelope fits, graphs up to 48 do
not) is reported as out of memory at graph capture, every other one is measured by the model.
"""

from __future__ import annotations

import re
from typing import Any

from api.documents import Confirmation, StudyDocument, Winner
from optimizer.sglang import ServerSettings
from spectune_sim.landscapes import LANDSCAPES
from spectune_sim.model import check_memory
from tests.support.api_client import Api
from tests.support.search import OOM, lease, ok, sim_levels
from tests.support.specs import INVENTORY, small_spec


def _starts(landscape: str, server: dict[str, Any]) -> bool:
    s = ServerSettings.model_validate(server)
    return check_memory(
        LANDSCAPES[landscape],
        s.speculative,
        max_running_requests=s.max_running_requests,
        cuda_graph_max_bs=s.cuda_graph_max_bs,
        cuda_graph_bs=s.cuda_graph_bs,
    ).ok


def _drive(api: Api, study: str, landscape: str, *, confirm_ooms: bool = False) -> list[dict[str, Any]]:
    handed: list[dict[str, Any]] = []
    for _ in range(80):  # bounded: a few trials, their baselines and confirmations
        if api.get(f"/v1/studies/{study}", "user").json()["state"] != "running":
            return handed
        for w in ("w1", "w2"):
            got = lease(api, w, INVENTORY | {"models": ["deploy-tight", "deploy-tight-eagle3"]})
            if got is None:
                continue
            handed.append(got)
            levels = got["workload"]["concurrency"]
            if not _starts(landscape, got["server"]) or (confirm_ooms and got["kind"] == "confirm"):
                body: dict[str, Any] = OOM
            else:
                body = ok(sim_levels(landscape, got["config"] if got["kind"] != "baseline" else None, levels))
            assert api.post(f"/v1/leases/{got['lease_id']}/complete", "fleet", body).status_code == 200
    raise AssertionError("the study did not finish")


def _create(api: Api, name: str, *, max_trials: int, top: int, deployed_requests: int | None = None) -> None:
    """A study of the deploy-tight engine at concurrency 16 (graphs up to 48 do not fit it)."""
    spec = small_spec(name, budget={"max_trials": max_trials})
    spec["model"] = {"target": "deploy-tight", "draft": "deploy-tight-eagle3"}
    spec["workload"] = {**spec["workload"], "concurrency": [16], "repeats": 2}
    if deployed_requests is not None:
        spec["serving"] = {"max_running_requests": deployed_requests}
    spec["confirmation"] = {"top": top}
    assert api.post("/v1/studies", "user", spec).status_code == 201


def _printed(document: StudyDocument, capsys: Any) -> dict[str, str]:
    """What the dashboard note, the HTML report's winner section and the demo print of the answer."""
    from api.demo import _print_result
    from api.notes import render_note
    from api.report.render import _winner

    capsys.readouterr()
    _print_result(document, [], "sqlite:///x.db", 1.0)
    import html

    report = html.unescape(_winner(document))
    return {"note": render_note(document, []), "report": report, "demo": capsys.readouterr().out}


def test_the_printed_command_is_the_server_a_confirmation_started(api: Api, capsys: Any) -> None:
    _create(api, "proof", max_trials=4, top=2, deployed_requests=48)
    handed = _drive(api, "proof", "deploy-tight")
    shown = api.get("/v1/studies/proof", "user").json()
    assert shown["state"] == "finished", shown["finish_reason"]
    confirms = [h for h in handed if h["kind"] == "confirm"]
    # Candidates are confirmed as they would be deployed: max running requests 48, graphs to 48 ...
    first = confirms[0]["server"]
    assert first["max_running_requests"] == 48 and first["cuda_graph_max_bs"] == 48 and first["cuda_graph_bs"] is None
    # ... which does not fit on this engine: the same configuration again with graphs up to 16.
    assert any(c["server"]["cuda_graph_max_bs"] == 16 for c in confirms)
    dep = shown["deployment"]
    winner = shown["winner"]
    assert dep["proven_by"] == winner["lease_id"] and dep["proven_by"] is not None
    assert "CUDA graphs up to batch 16" in dep["reason"] and "out of memory" in dep["reason"].replace("GPU ", "")
    # The printed server is exactly the one that confirmation started, and it starts.
    proving = next(c for c in confirms if c["lease_id"] == dep["proven_by"])
    assert dep["server"] == proving["server"] and _starts("deploy-tight", dep["server"])
    assert "--max-running-requests 48" in dep["launch_command"]
    assert "--cuda-graph-max-bs-decode 16" in dep["launch_command"]
    # One record: best is the answer; the search's best trial is best_measured.
    assert shown["best"] == winner and shown["best_measured"]["trial_number"] is not None
    assert winner["launch_command"] == dep["launch_command"]
    assert winner["levels"] and winner["baseline_levels"]
    from api.report.tables import study_summary

    document = StudyDocument.model_validate(shown)
    summary = study_summary(document)
    assert f"launched exactly as printed by confirmation lease {dep['proven_by']}" in summary
    (best_line,) = [line for line in summary.splitlines() if line.startswith("best ")]
    assert best_line.endswith(" (confirmation)") and "judged   by output-throughput speedup" in summary
    from api.notes import render_note

    note = render_note(document, [])
    assert f"launched exactly as printed (lease {dep['proven_by']})" in note and dep["launch_command"] in note
    # One set of numbers: the winner table shows the settings as launched (the command pins graphs
    # to 16 where the configuration says nothing) and says which measurement each figure is; the
    # note states the workload as measured and the objective first.
    printed = _printed(document, capsys)
    assert winner["config"]["cuda_graph_max_bs"] is None
    assert "<th>cuda_graph_max_bs (as launched)</th><td>16</td>" in printed["report"]
    assert "<th>max_running_requests (as launched)</th><td>48</td>" in printed["report"]
    assert "speedup (objective; confirmation)" in printed["report"]
    assert "speedup in the search (one launch before the confirmation)" in printed["report"]
    assert f"- workload: {shown['workload']}" in note and "×** the baseline (confirmation)" in note
    assert note.splitlines()[2] == "**Objective:** output-throughput speedup, at concurrency 16"
    # Every renderer prints the proven command with the lease that started it, and only it.
    printed = printed | {"show": study_summary(document)}
    assert dep["load_line"] == "proven at concurrency 16; admits at most 48 running requests"
    for where, text in printed.items():
        assert dep["launch_command"].splitlines()[-1] in text, where
        assert dep["proven_by"] in text, where
        # The load it was proven at and what it admits, on the last line before the command.
        # The report's HTML: each element on its own line (the placeholders' <...> stay).
        plain = re.sub(r"</?(?:p|pre|table|tr|th|td)\b[^>]*>", "\n", text)
        before = plain[: plain.index(dep["launch_command"].splitlines()[0])].rstrip().splitlines()
        last = [line for line in before if line.strip() not in ("", "```")][-1]
        assert last.rstrip(":").endswith(dep["load_line"]), (where, last)
    # The search's best trial is not the answer: it prints no command of its own.
    assert shown["best_measured"]["launch_command"] is None
    # The host is the confirming one everywhere; the search's host is kept apart.
    assert winner["worker_id"] == winner["confirmed_on"] and "search_worker_id" in winner


def test_when_no_deployment_starts_the_study_says_so_and_prints_no_command(api: Api, capsys: Any) -> None:
    _create(api, "noproof", max_trials=3, top=1, deployed_requests=48)
    handed = _drive(api, "noproof", "deploy-tight", confirm_ooms=True)
    shown = api.get("/v1/studies/noproof", "user").json()
    assert shown["state"] == "finished"
    # Every envelope the serving section allows was tried, each a stated failure.
    assert len([h for h in handed if h["kind"] == "confirm"]) == 3
    assert shown["deployment"] is None
    assert shown["verdict"].startswith("no command: none of the candidates' deployments started")
    assert "out of GPU memory while capturing CUDA graphs" in shown["verdict"]
    # No command anywhere: not in the document, the note, the report or the demo (each says why).
    assert shown["winner"]["launch_command"] is None and shown["best"]["launch_command"] is None
    document = StudyDocument.model_validate(shown)
    assert document.printed_command() is None
    for where, text in _printed(document, capsys).items():
        assert "sglang.launch_server" not in text and "--speculative" not in text, where
        assert "none of the candidates' deployments started" in text, where


def test_export_has_the_confirmation_rows() -> None:
    from api.report.export import to_csv

    confirmation = Confirmation.model_validate(
        dict.fromkeys(Confirmation.model_fields)
        | {
            "trial_number": 3,
            "state": "completed",
            "attempt": 1,
            "lease_id": "L-3",
            "envelope_note": "",
            "extra_passes": 0,
            "saturated": {},
            "adaptive": False,
            "launches": 1,
            "config": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3},
            "speedup": 1.2,
            "worker_id": "w2",
            "speedup_by_level": {"16": 1.2},
            "levels": [{"concurrency": 16, "output_tok_s": 120.0}],
            "baseline_levels": [{"concurrency": 16, "output_tok_s": 100.0}],
        }
    )
    text = to_csv("s", [], [confirmation])
    row = text.splitlines()[1].split(",")
    header = text.splitlines()[0].split(",")
    got = dict(zip(header, row, strict=True))
    assert got["source"] == "confirmation" and got["state"] == "confirmation completed"
    assert got["concurrency"] == "16" and got["speedup"] == "1.2" and got["baseline_tok_s"] == "100.0"
    assert got["worker_id"] == "w2"


def test_a_command_no_launch_started_says_so() -> None:
    from api.services.studies import _proof
    from optimizer.deploy import plan_deployment
    from optimizer.space import SpecConfig
    from optimizer.spec import parse_spec

    spec = parse_spec({"name": "n", "model": {"target": "t", "draft": "d"}, "workload": {"concurrency": [1, 8]}})
    cfg = SpecConfig(num_steps=2, topk=1, num_draft_tokens=3)
    winner = Winner.model_construct(config=cfg, confirmed=False, trial_number=1, server=None, envelope_note="")
    static = plan_deployment(spec, cfg, pays=True, exported=None, version="0.5.23")
    dep, verdict = _proof(static, winner, [], [])
    assert verdict is None and dep is not None and dep.proven_by is None
    assert "not confirmed" in dep.proof_note
    plain = plan_deployment(spec, cfg, pays=False, exported=None, version="0.5.23")
    dep, _ = _proof(plain, winner.model_copy(update={"confirmed": True}), [], [])
    assert dep is not None and "baselines ran this server" in dep.proof_note


def test_a_confirmation_whose_every_envelope_is_known_to_run_out_of_memory_is_not_launched(api: Api) -> None:
    """Issue 17 item 1: a smaller configuration ran out of memory in every envelope the serving
    section leaves, so a queued confirmation of a larger one would only repeat that failure."""
    from datetime import UTC, datetime

    from api.models import EventRow, LeaseRow
    from api.services.lease_rows import ConfirmInfo, lease_payload
    from api.services.leasing.records import DEPLOY_FAILED
    from api.services.study_specs import spec_of
    from optimizer.space import SpecConfig

    _create(api, "known-oom", max_trials=3, top=1, deployed_requests=48)
    ctx = api.client.app.state.ctx  # type: ignore[attr-defined]
    handed: list[dict[str, Any]] = []
    taught = False
    for _ in range(80):  # bounded: a few trials, their baselines and confirmations
        shown = api.get("/v1/studies/known-oom", "user").json()
        if shown["state"] != "running":
            break
        if shown["phase"] == "confirmation" and not taught:
            # The smallest configuration failed at start-up in every tier (what another
            # candidate's confirmations would have taught).
            with ctx.write_sessions() as s, s.begin():
                # As the service stores a confirmation's payload: every read of it is typed.
                known_oom = spec_of(s, "known-oom")
                smallest = SpecConfig(num_steps=1, topk=1, num_draft_tokens=2)
                for tier in range(6):
                    s.add(
                        LeaseRow(
                            id=f"taught-{tier}",
                            study_name="known-oom",
                            kind="confirm",
                            state="failed",
                            worker_id="w9",
                            trial_number=None,
                            attempt=1,
                            config_key=None,
                            payload=lease_payload(known_oom, smallest, confirm=ConfirmInfo(tier=tier)).doc(),
                            created_at=datetime.now(UTC).replace(tzinfo=None),
                            result={"outcome": "failed", "failure": {"kind": "oom", "message": "capturing cuda graph"}},
                        )
                    )
            taught = True
        got = lease(api, "w1", INVENTORY | {"models": ["deploy-tight", "deploy-tight-eagle3"]})
        if got is None:
            continue
        handed.append(got)
        if not _starts("deploy-tight", got["server"]):
            body: dict[str, Any] = OOM
        else:
            body = ok(
                sim_levels(
                    "deploy-tight", got["config"] if got["kind"] != "baseline" else None, got["workload"]["concurrency"]
                )
            )
        assert api.post(f"/v1/leases/{got['lease_id']}/complete", "fleet", body).status_code == 200
    else:
        raise AssertionError("the study did not finish")
    assert taught
    # No confirmation was launched: the queued one ended as a deployment failure, stated.
    assert [h for h in handed if h["kind"] == "confirm"] == []
    with ctx.sessions() as s:
        from sqlalchemy import select

        ended = s.scalars(
            select(LeaseRow).where(
                LeaseRow.study_name == "known-oom", LeaseRow.kind == "confirm", LeaseRow.trial_number.is_not(None)
            )
        ).all()
        assert ended and all(r.state == "failed" and r.leased_at is None for r in ended)
        said = [e.detail for e in s.scalars(select(EventRow).where(EventRow.kind == DEPLOY_FAILED))]
    assert any("was not launched" in d for d in said), said
    assert shown["deployment"] is None or shown["deployment"]["proven_by"] is None


def test_an_unconfirmed_answer_prints_its_command_with_why_it_is_not_proven(api: Api, capsys: Any) -> None:
    _create(api, "unconfirmed", max_trials=3, top=0)
    _drive(api, "unconfirmed", "deploy-tight")
    shown = api.get("/v1/studies/unconfirmed", "user").json()
    dep = shown["deployment"]
    assert dep is not None and dep["proven_by"] is None and dep["proof_note"].startswith("not confirmed")
    assert shown["winner"]["launch_command"] == dep["launch_command"]
    for where, text in _printed(StudyDocument.model_validate(shown), capsys).items():
        assert dep["launch_command"].splitlines()[-1] in text and "not confirmed" in text, where
