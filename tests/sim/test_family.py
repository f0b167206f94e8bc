"""The family of drawn engines (spectune_sim.family) and the model forms it draws from."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from spectune_sim import family as F
from spectune_sim.landscapes import DENSE_8B_H100, MOE_PCIE, UnknownLandscapeError, get_landscape
from spectune_sim.model import (
    NoiseModel,
    accept_length,
    check_memory,
    cycle_timing,
    depth_acceptance,
    forward_ms,
    graph_plan,
    true_optimum,
)
from spectune_sim.rules import DraftTree, TreeGrid
from tests.support.helpers import sim_engine

DRAWS = 200


@pytest.fixture(scope="module")
def drawn() -> list[F.DrawnEngine]:
    return [F.engine(k) for k in range(DRAWS)]


# -- the forms the family draws from (spectune_sim.model)


def test_rank_dependent_tree_gain_is_the_flat_gain_when_every_doubling_cuts_alike() -> None:
    flat = dataclasses.replace(DENSE_8B_H100, tree_gain=0.2)
    same = dataclasses.replace(DENSE_8B_H100, tree_gain=0.9, tree_gain_by_doubling=(0.2,))
    falling = dataclasses.replace(DENSE_8B_H100, tree_gain_by_doubling=(0.3, 0.05))
    for tree in [(4, 2, 9), (4, 8, 33), (6, 4, 25)]:
        assert depth_acceptance(same, *tree) == pytest.approx(depth_acceptance(flat, *tree))
    # The second doubling of a falling-by-rank tree gains less than its first.
    chain, two, four = (depth_acceptance(falling, 3, k, 1 + 3 * k)[0] for k in (1, 2, 4))
    assert (1 - two) / (1 - chain) == pytest.approx(0.7)
    assert (1 - four) / (1 - two) == pytest.approx(0.95)


def test_expert_saturation_makes_the_verify_cost_concave() -> None:
    moe = dataclasses.replace(MOE_PCIE, verify_slope=0.0, verify_slope_after=0.0, moe_experts=256, moe_active=8)
    moe = dataclasses.replace(moe, moe_expert_share=0.2)
    costs = [forward_ms(moe, n) / moe.decode_ms for n in (1, 2, 4, 8, 16, 32, 64)]
    assert costs[0] == 1.0
    steps = [b - a for a, b in zip(costs, costs[1:], strict=False)]
    per_token = [s / n for s, n in zip(steps, (1, 2, 4, 8, 16, 32), strict=False)]
    assert all(b < a for a, b in zip(per_token, per_token[1:], strict=False)), per_token
    # Every expert loaded: the cost stops at share x (E/a - 1).
    assert forward_ms(moe, 10_000) / moe.decode_ms == pytest.approx(1 + 0.2 * (256 / 8 - 1), rel=1e-3)


def test_draft_latency_and_width_cost_add_per_step_as_stated() -> None:
    plain = DENSE_8B_H100
    slow = dataclasses.replace(plain, draft_step_latency_ms=0.5, draft_width_ms_per_token=0.01)
    plan = graph_plan(plain, speculative=True, max_running_requests=8)
    tree = DraftTree(5, 4, 16)
    extra = cycle_timing(slow, tree, 8, plan).draft_ms - cycle_timing(plain, tree, 8, plan).draft_ms
    assert extra == pytest.approx(5 * (0.5 + 0.01 * 8 * 3))


# -- the generator


def test_an_engine_is_a_pure_function_of_version_and_index() -> None:
    """The same engine in another process (Python salts str hashes per process: no hash() may feed it)."""
    code = "from spectune_sim import family as F; e = F.engine(7); print(repr((e.landscape, e.levels, e.host_offsets)))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    e = F.engine(7)
    assert other.stdout.strip() == repr((e.landscape, e.levels, e.host_offsets))
    assert F.engine(7) == e
    assert F.engine(8).landscape != e.landscape
    with pytest.raises(F.FamilyError, match="version 2"):
        F.engine(7, version=2)


def test_drawn_engines_span_the_stated_forms_and_ranges(drawn: list[F.DrawnEngine]) -> None:
    forms = Counter(f for e in drawn for f in e.forms)
    assert set(forms) == set(F.FORMS), f"forms never drawn: {set(F.FORMS) - set(forms)}"
    assert min(forms.values()) >= 10, forms
    subs = Counter(e.subfamily for e in drawn)
    assert subs == {"seed-like": 40, "memory-tight": 40, "two-level": 40, "general": 80}
    offsets = [o for e in drawn for o in e.host_offsets]
    assert 0.0 <= min(offsets) < 0.005 and 0.07 < max(offsets) <= F.HOST_OFFSET_MAX
    sigmas = [e.landscape.launch_sigma for e in drawn]
    assert F.LAUNCH_SIGMA[0] <= min(sigmas) < 0.008 and 0.037 < max(sigmas) <= F.LAUNCH_SIGMA[1]
    assert {len(e.levels) for e in drawn if e.subfamily == "two-level"} == {2}
    assert {len(e.levels) for e in drawn if e.subfamily != "two-level"} == {1}
    # Not monotone in the draft position in a good share, and each non-monotone one is so.
    bumpy = [e for e in drawn if "non-monotone-acceptance" in e.forms]
    assert len(bumpy) >= DRAWS // 4
    for e in bumpy:
        a = e.landscape.accept_by_depth
        assert any(y > x for x, y in zip(a, a[1:], strict=False)) and any(y < x for x, y in zip(a, a[1:], strict=False))
    assert all(e.name == F.engine_name(e.index) for e in drawn)


def test_seed_like_engines_gain_two_to_six_percent_at_their_best(drawn: list[F.DrawnEngine]) -> None:
    """The truth is the simulator's exhaustive optimum over the default space at concurrency 1."""
    seeds = [e for e in drawn if e.subfamily == "seed-like"]
    assert seeds
    for e in seeds:
        ls = e.landscape
        assert (ls.tp_size, e.levels, ls.moe_experts > 0 or ls.verify_knee > 0) == (8, (1,), True)
        assert "pcie" in ls.host
        _, speedup = true_optimum(ls, TreeGrid(), 1)
        assert 1.02 <= speedup <= 1.06, (e.name, speedup)


def test_memory_tight_engines_run_out_of_memory_near_their_optimum(drawn: list[F.DrawnEngine]) -> None:
    for e in (e for e in drawn if e.subfamily == "memory-tight"):
        top = max(e.levels)
        configs = list(TreeGrid().iter_configs())
        fails = [
            c for c in configs if not check_memory(e.landscape, c, max_running_requests=top, cuda_graph_bs=e.levels).ok
        ]
        assert 0.1 <= len(fails) / len(configs) <= 0.85, e.name
        assert "memory-cliff" in e.forms
        assert check_memory(e.landscape, None, max_running_requests=top, cuda_graph_bs=e.levels).ok
        assert check_memory(e.landscape, e.best_config, max_running_requests=top, cuda_graph_bs=e.levels).ok


def test_subfamilies_are_selected_by_index() -> None:
    ks = F.indices(5, "seed-like", first=3)
    assert ks == [5, 10, 15, 20, 25]
    assert all(F.subfamily_of(k) == "seed-like" for k in ks)
    assert F.indices(3) == [0, 1, 2]
    with pytest.raises(F.FamilyError, match=">= 0"):
        F.subfamily_of(-1)


def test_a_drawn_engine_is_served_by_name_like_a_landscape() -> None:
    assert get_landscape("/models/family-v1-0003") == F.engine(3).landscape
    for bad in ("family-v2-0003", "family-v1-x"):
        with pytest.raises(UnknownLandscapeError, match="drawn engines"):
            get_landscape(bad)


def test_host_offsets_slow_each_host_by_its_own_share() -> None:
    e = F.engine(4)
    noise = e.noise(NoiseModel(spec_host_sigma=0.0)).scaled(2.0)  # scaling keeps the offsets
    for i, offset in enumerate(e.host_offsets):
        assert noise.spec_host_factor(0, f"h{i}") == pytest.approx(1.0 + offset)
    assert noise.spec_host_factor(0, "elsewhere") == 1.0
    assert max(e.host_offsets) > 0.0 and not math.isclose(e.host_offsets[0], e.host_offsets[1])


def test_the_simulated_server_serves_a_drawn_engine(tmp_path: Path) -> None:
    """A real server process on a drawn engine: its expected accept length is the family engine's."""
    e = F.engine(2)
    args = ["--model-path", f"/models/{e.name}", "--speculative-algorithm", "EAGLE3"]
    args += ["--speculative-draft-model-path", "d", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
    args += ["--speculative-num-draft-tokens", "4", "--max-running-requests", "4"]
    env = {"SPECTUNE_SIM_TIME_SCALE": "0.001", "SPECTUNE_SIM_SPEED": "20", "SPECTUNE_SIM_NOISE": "0"}
    with sim_engine(args, log_path=tmp_path / "sim.log", env=env) as (url, _):
        info = httpx.get(f"{url}/server_info", timeout=10).json()["spectune_simulator"]
    assert info["landscape"] == e.name
    expected = accept_length(depth_acceptance(e.landscape, 3, 1, 4))
    assert info["expected_accept_length"] == pytest.approx(expected)
