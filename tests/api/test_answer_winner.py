"""One winner (issue 32 item 2): the candidate the conductor re-launches is the winner the study
document shows (optimizer.answer.winner), so a best-measured trial that is quarantined, or whose
confirmation measured a saturated host, is neither re-launched nor shown as the winner."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.services.trial_records import screened
from optimizer import conductor as c
from optimizer.analysis import LaunchNoise
from tests.optimizer.test_conductor import BASES, BEGAN, FOUR, base, confirming
from tests.optimizer.test_relaunch import BASE_LEVELS, done
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.specs import INVENTORY, small_spec

# ------------------------------------------------------------------------------ the conductor


@pytest.fixture
def noisy_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    # Launch noise (1.4%) dominates the tight passes: a winner straddling 1.0 is worth one more launch.
    monkeypatch.setattr(c, "launch_noise", lambda snap: LaunchNoise(0.014**2, 3, 6.0))


# Each host measured the baseline its confirmation paired with after the phase began, so a
# relaunch pairs with one and costs its own launch (optimizer.decide).
PAIRED = (*BASES, base("w1", BEGAN, id_=3), base("w2", BEGAN, id_=4))


def _saturated(lease: c.LeaseView) -> c.LeaseView:
    assert lease.measurement is not None
    levels = [{**lv, "saturated": "the load generator fell behind"} for lv in lease.measurement[0]]
    return replace(lease, measurement=(levels, BASE_LEVELS))


@pytest.mark.usefixtures("noisy_launches")
@pytest.mark.parametrize("why", ["quarantined", "saturated"])
def test_a_best_that_cannot_be_the_answer_is_not_relaunched_and_not_the_winner(why: str) -> None:
    # Trial 1 searched best (1.08x) and confirmed ahead of trial 3 (searched 1.01x, tests/optimizer/test_conductor.py's
    # FOUR); both confirmations straddle 1.0.
    best, other = done("c0", 1, 1.025), done("c1", 3, 1.01, worker="w2")
    clean = confirming(leases=(best, other), baselines=PAIRED)
    action = c.relaunches(clean)
    choice = c.winner(clean)
    assert choice is not None and choice.winner.trial_number == 1
    assert action is not None and [x.trial_number for x in action.candidates] == [1]
    if why == "quarantined":  # an admin quarantined trial 1: every reader sees it as a failure
        s = replace(clean, trials=screened(FOUR, {1: "forged measurement"}))
    else:  # trial 1's confirmation measured the host's load, not the configuration
        s = confirming(leases=(_saturated(best), other), baselines=PAIRED)
    choice = c.winner(s)
    assert choice is not None and choice.winner.trial_number == 3
    assert all(t.trial_number != 1 for t in choice.ties)
    action = c.relaunches(s)
    # The winner shown is what one more launch resolves, never the best that cannot be the answer.
    assert action is not None and [x.trial_number for x in action.candidates] == [3]
    assert action.why.startswith("2/2/4 at 1.010x")  # trial 3's configuration
    # Alone, it is no answer to resolve: nothing is re-launched.
    only = (
        replace(clean, trials=screened(FOUR, {1: "forged"}), leases=(best,))
        if why == "quarantined"
        else confirming(leases=(_saturated(best),), baselines=PAIRED)
    )
    assert c.relaunches(only) is None


# ------------------------------------------------------------------------------ through the API


@pytest.fixture
def pg_api(pg_db_url: str, tmp_path: Path) -> Iterator[Api]:
    from api.app import create_app

    settings = make_settings(pg_db_url, artifact_dir=str(tmp_path / "artifacts"))
    with TestClient(create_app(settings)) as client:
        yield Api(client, make_tokens(pg_db_url), pg_db_url)


def _levels(speedup: float) -> dict[str, Any]:
    tok = 100.0 * speedup
    level = {"concurrency": 1, "output_tok_s": tok, "output_tok_s_runs": [tok - 0.1, tok, tok + 0.1]}
    return {"outcome": "ok", "metrics": {"levels": [level], "startup_s": 3.0, "sglang_version": "0.5.23"}}


def test_a_quarantined_best_is_not_relaunched_and_the_document_shows_another_winner(pg_api: Api) -> None:
    """Two candidates measured 1.03x and 1.025x in the search, confirmed at 1.015x and 1.012x,
    both straddling 1.0 on launch noise (tight passes) and both likely enough to clear it with one
    more launch: the study re-launches its winner.  The best is quarantined by an admin while its confirmation runs: the study
    re-launches the other one, never the quarantined one (ranked by its confirmation alone it
    would lead: the choice without the quarantine re-launched it), and the document's winner is
    the other one."""
    from api.services.trial_records import repair_trial

    api, name = pg_api, "onewinner"
    spec = small_spec(name, budget={"max_trials": 2, "converge": False}, confirmation={"top": 2})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    search = iter((1.03, 1.025))
    searched: dict[int, float] = {}
    confirms: list[int] = []
    ctx = api.client.app.state.ctx  # type: ignore[attr-defined]
    for _ in range(60):  # bounded: baselines, two trials, their confirmations and the re-launches
        if api.get(f"/v1/studies/{name}", "user").json()["state"] != "running":
            break
        for w in ("w1", "w2"):
            r = api.post(f"/v1/workers/{w}/lease", "fleet", INVENTORY)
            assert r.status_code in (200, 204), r.text
            if r.status_code == 204:
                continue
            lease = r.json()
            number = lease.get("trial_number")
            if lease["kind"] == "baseline":
                body = _levels(1.0)
            elif lease["kind"] == "trial":
                searched[int(number)] = next(search)
                body = _levels(searched[int(number)])
            else:
                confirms.append(int(number))
                is_best = searched[int(number)] == max(searched.values())
                if is_best and confirms.count(int(number)) == 1:
                    # Quarantined while its confirmation runs: that confirmation still completes,
                    # before or after the other's, and the study settles on what is left.
                    repair_trial(ctx.write_sessions, name, int(number), quarantine="forged measurement")
                body = _levels(1.015 if is_best else 1.012)
            done = api.post(f"/v1/leases/{lease['lease_id']}/complete", "fleet", body)
            assert done.status_code == 200, done.text
    shown = api.get(f"/v1/studies/{name}", "user").json()
    assert shown["state"] == "finished", shown["finish_reason"]
    best = max(searched, key=searched.__getitem__)
    other = min(searched, key=searched.__getitem__)
    # The quarantined best was confirmed once and never re-launched; the other was, as the winner.
    assert confirms.count(best) == 1 and confirms.count(other) >= 2, confirms
    winner = shown["winner"]
    assert winner["trial_number"] == other
    assert best not in {t["trial_number"] for t in winner.get("ties") or []}
    assert shown["best"]["trial_number"] == other
