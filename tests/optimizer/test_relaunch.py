"""One more confirmation launch where the answer straddles its decision on launch noise alone
(issue 17 item 4): the conductor's decision (`relaunches`), what bounds it, where it runs, and the
pooled interval the answer then reads (optimizer.confirmation.pooled_result).  Pure: snapshots in,
actions out."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from optimizer import conductor as c
from optimizer import confirmation as confirm
from optimizer import ranking
from optimizer.analysis import Interval, LaunchNoise
from optimizer.conductor import confirming as confirming_phase
from tests.optimizer.test_conductor import BASES, BEGAN, FOUR, T0, base, confirming, host

RUNS = [99.9, 100.0, 100.1]
BASE_LEVELS = [{"concurrency": 1, "output_tok_s": 100.0, "output_tok_s_runs": RUNS}]


def measurement(speedup: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    tok = 100.0 * speedup
    return [{"concurrency": 1, "output_tok_s": tok, "output_tok_s_runs": [tok - 0.1, tok, tok + 0.1]}], BASE_LEVELS


def done(lid: str, number: int, speedup: float, worker: str = "w1", minute: int = 0) -> c.LeaseView:
    at = T0 - timedelta(minutes=4 - minute)
    return c.LeaseView(
        lid, "confirm", "completed", number, worker_id=worker, created_at=at, leased_at=at, finished_at=at,
        measurement=measurement(speedup),
    )  # fmt: skip


@pytest.fixture(autouse=True)
def launch_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    # A launch-to-launch sd of 1.4% (answer_quality's small-gain engine), which the tight passes
    # above cannot show: the study's estimate as `launch_noise` would give it.
    monkeypatch.setattr(confirming_phase, "launch_noise", lambda snap: LaunchNoise(0.014**2, 3, 6.0))


def test_a_winner_straddling_one_on_launch_noise_gets_one_more_launch_on_another_host() -> None:
    s = confirming(leases=(done("c0", 1, 1.02, worker="w1"),))
    action = c.settle(s)
    assert isinstance(action, c.Reconfirm)
    assert [cand.trial_number for cand in action.candidates] == [1]
    assert action.candidates[0].avoid_worker == "w1"  # the host that confirmed it last
    assert "straddles 1.0" in action.why


def test_a_clear_winner_gets_none() -> None:
    s = confirming(leases=(done("c0", 1, 1.10), done("c1", 0, 1.04, worker="w2")))
    assert isinstance(c.settle(s), c.Finish)


def test_a_straddle_one_launch_cannot_lift_clear_is_not_relaunched(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.99x with a launch noise of 1.4%: pooled with one more launch, its interval clears 1.0 only
    # if that launch comes in near 1.05x, a chance of about 1% (< p_matters): the verdict stands.
    s = confirming(leases=(done("c0", 1, 0.99, worker="w1"),))
    assert isinstance(c.settle(s), c.Finish)
    # 1.02x whose passes alone are wide (no launch noise): one more launch, with its own passes,
    # lifts it clear with a chance of about 16%, so it is launched; at 1.005x (about 4%) it is not.
    monkeypatch.setattr(confirming_phase, "launch_noise", lambda snap: LaunchNoise(0.0, 0, 0.0))

    def wide(speedup: float) -> c.LeaseView:
        tok = 100.0 * speedup
        return c.LeaseView(
            "c0", "confirm", "completed", 1, worker_id="w1", created_at=BEGAN, finished_at=T0,
            measurement=([{"concurrency": 1, "output_tok_s": tok, "output_tok_s_runs": [tok - 5, tok, tok + 5]}], BASE_LEVELS),
        )  # fmt: skip

    # w2, the host it goes to, holds a baseline measured after the confirmation began, so the
    # relaunch costs one launch (optimizer.decide).
    paired = (*BASES, base("w2", BEGAN + timedelta(minutes=1), id_=3))
    assert isinstance(c.settle(confirming(leases=(wide(1.02),), baselines=paired)), c.Reconfirm)
    assert isinstance(c.settle(confirming(leases=(wide(1.005),), baselines=paired)), c.Finish)


def test_a_relaunch_that_needs_its_own_baseline_must_be_twice_as_likely(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule prices the relaunch's GPU-seconds (optimizer.decide.worth): where no other host
    holds a baseline the relaunch may pair with, it costs that baseline's launch too, and a 16%
    chance per two launches is under `p_matters`; with the study's `per_cost` off it is launched."""
    monkeypatch.setattr(confirming_phase, "launch_noise", lambda snap: LaunchNoise(0.0, 0, 0.0))
    tok = 102.0
    wide = c.LeaseView(
        "c0", "confirm", "completed", 1, worker_id="w1", created_at=BEGAN, finished_at=T0,
        measurement=([{"concurrency": 1, "output_tok_s": tok, "output_tok_s_runs": [tok - 5, tok, tok + 5]}], BASE_LEVELS),
    )  # fmt: skip
    assert isinstance(c.settle(confirming(leases=(wide,))), c.Finish)
    off = replace(confirming(leases=(wide,)), policy=replace(confirming().policy, per_cost=False))
    assert isinstance(c.settle(off), c.Reconfirm)


def test_the_chance_to_clear_is_the_preposterior_of_the_pooled_interval() -> None:
    """One launch whose interval is centred 1.96 sd/sqrt(2) above 1.0 clears with an even chance;
    the chance grows with the value and falls as more launches already hold the interval."""
    sd = 0.02

    def iv(v: float) -> Interval:
        return Interval(v, v * math.exp(-1.96 * sd), v * math.exp(1.96 * sd))

    even = math.exp(1.96 * sd / math.sqrt(2))
    assert confirm.clear_chance(iv(even), 1) == pytest.approx(0.5, abs=1e-6)
    chances = [confirm.clear_chance(iv(v), 1) for v in (0.98, 1.0, 1.01, 1.02, 1.04)]
    assert chances == sorted(chances) and chances[0] < 0.01 and chances[-1] > 0.5
    # The same interval held by three launches: one more moves it less.
    assert confirm.clear_chance(iv(1.01), 3) < confirm.clear_chance(iv(1.01), 1)
    assert confirm.clear_chance(Interval(1.02, 1.02, 1.02), 1) == 0.0  # no spread: nothing to move


def test_the_users_budget_bounds_the_relaunches_and_the_policy_switches_them_off() -> None:
    """The chance decides how many; what bounds them is the study's `budget.max_trials` (the cap
    of 2 per study is gone: benchmarks/README.md "The relaunch cap, removed (stop 45)")."""
    leases = (
        done("c0", 1, 1.02, minute=0),
        done("c1", 1, 1.01, worker="w2", minute=1),
        done("c2", 1, 1.015, minute=2),
    )
    s = confirming(leases=leases)
    assert c.extra_launches(s) == 2 < s.spec.budget.max_trials
    # Two spent, still straddling and one more can lift it: ordered (the old cap of 2 said Finish).
    assert isinstance(c.settle(s), c.Reconfirm)
    # The budget spent: the verdict says what the data holds.
    tight = replace(s, spec=s.spec.model_copy(update={"budget": s.spec.budget.model_copy(update={"max_trials": 2})}))
    assert isinstance(c.settle(tight), c.Finish)
    # `relaunch` False: none at all.
    off = confirming(leases=leases[:1], policy=replace(s.policy, relaunch=False))
    assert isinstance(c.settle(off), c.Finish)
    assert isinstance(c.settle(confirming(leases=leases[:1])), c.Reconfirm)


def test_a_tied_runner_up_is_called_a_tie_not_relaunched() -> None:
    """Two candidates a confirmation each cannot order, no trusted model: no more launches (they
    bought nothing on zigzag-tiles, benchmarks/README.md); the verdict says they are tied."""
    s = confirming(leases=(done("c0", 1, 1.06), done("c1", 0, 1.065, worker="w2")))
    assert ranking.of(s.spec, s.trials) is None
    assert c.relaunches(s) is None
    assert isinstance(c.settle(s), c.Finish)
    choice = c.winner(s)
    assert choice is not None and len(choice.ties) == 1
    assert {choice.winner.trial_number, choice.ties[0].trial_number} == {0, 1}


def test_a_tied_winner_that_straddles_one_is_still_relaunched_alone() -> None:
    # Each host measured the baseline its confirmation paired with after the phase began.
    paired = (*BASES, base("w1", BEGAN, id_=3), base("w2", BEGAN, id_=4))
    s = confirming(leases=(done("c0", 1, 1.01), done("c1", 0, 1.012, worker="w2")), baselines=paired)
    action = c.settle(s)
    assert isinstance(action, c.Reconfirm) and len(action.candidates) == 1
    assert "straddles 1.0" in action.why


def test_on_one_host_the_relaunch_waits_for_a_fresh_baseline() -> None:
    """The same host's baseline already paired with the first launch: pooling them would count
    that baseline twice, so a new one comes first."""
    fresh = base("w1", BEGAN, id_=7)
    first = done("c0", 1, 1.02, minute=1)
    queued = c.LeaseView("c5", "confirm", "queued", 1, created_at=T0)
    s = confirming(leases=(first, queued), baselines=(*BASES, fresh), hosts=(host("w1"),))
    assert c.next_action(s, "w1") == c.MeasureBaseline("w1", for_confirmation=True)
    newer = base("w1", T0 - timedelta(seconds=30), id_=8)
    s2 = confirming(leases=(first, queued), baselines=(*BASES, fresh, newer), hosts=(host("w1"),))
    action = c.next_action(s2, "w1")
    assert isinstance(action, c.Confirm) and action.baseline_id == 8


def test_the_answer_pools_the_confirmation_launches_never_the_search_launch() -> None:
    s = confirming(leases=(done("c0", 1, 1.02, minute=0), done("c1", 1, 1.04, worker="w2", minute=1)))
    docs = c.contenders(s)
    assert len(docs) == 1 and docs[0].launches == 2
    one = confirm.confirm_result(s.spec, *measurement(1.02), 0.014**2)
    both = confirm.pooled_result(s.spec, [measurement(1.02), measurement(1.04)], 0.014**2)
    assert both.value == pytest.approx(math.sqrt(1.02 * 1.04), rel=1e-4)  # (nearly) equal weights
    assert one.interval is not None and both.interval is not None
    half = math.log(one.interval.high / one.interval.low)
    assert math.log(both.interval.high / both.interval.low) == pytest.approx(half / math.sqrt(2), rel=1e-3)
    assert docs[0].speedup == pytest.approx(both.value)
    # FOUR's trial 1 searched at 1.08: the pooled figure ignores it.
    assert FOUR[1].value == 1.08 and docs[0].speedup < 1.04


def test_a_failed_start_retried_is_not_an_extra_launch() -> None:
    failed = c.LeaseView("c0", "confirm", "failed", 1, worker_id="w1", created_at=BEGAN, finished_at=BEGAN)
    s = confirming(leases=(failed, replace(done("c1", 1, 1.10), created_at=T0)))
    assert c.extra_launches(s) == 0
