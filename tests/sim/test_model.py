"""The simulator's pure model: calibration targets, landscape shapes, graphs, memory, noise."""

from __future__ import annotations

import random

import pytest

from optimizer.space import SearchSpace, SpecConfig
from spectune_sim.landscapes import LANDSCAPES, UnknownLandscapeError, get_landscape
from spectune_sim.model import (
    AcceptAccumulator,
    InfeasibleConfigError,
    NoiseModel,
    accept_length,
    capture_sizes,
    check_memory,
    depth_acceptance,
    graph_plan,
    memory_required_gb,
    predict,
    sample_accept_tokens,
    startup_seconds,
    true_optimum,
)

LEVELS = (1, 4, 16, 64)


def chain(steps: int, bs: int | None = None) -> SpecConfig:
    return SpecConfig(num_steps=steps, topk=1, num_draft_tokens=steps + 1, cuda_graph_max_bs=bs)


def test_moe_pcie_reproduces_the_reference_case_at_batch_size_1():
    ls = get_landscape("moe-pcie")
    assert predict(ls, None, 1).output_tok_s == pytest.approx(90.0, rel=0.05)
    for steps, published in ((2, 94.0), (5, 71.3), (10, 60.0)):
        assert predict(ls, chain(steps), 1).output_tok_s == pytest.approx(published, rel=0.05), steps
    by_steps = {k: predict(ls, chain(k), 1).output_tok_s for k in range(1, 11)}
    assert max(by_steps, key=by_steps.__getitem__) == 2
    # The steps-10 row: AL 2.0-2.95 with a per-token accept rate of 0.16-0.27 (docs/calibration.md §1).
    p10 = predict(ls, chain(10), 1)
    assert 2.6 <= p10.accept_length <= 2.95
    assert 0.16 <= p10.accept_rate <= 0.27


def test_dense_8b_speedup_falls_as_the_batch_grows():
    ls = get_landscape("dense-8b-h100")
    assert predict(ls, None, 1).output_tok_s == pytest.approx(158.3, rel=0.02)
    fixed = [
        predict(ls, chain(3), b, max_running_requests=64).output_tok_s
        / predict(ls, None, b, max_running_requests=64).output_tok_s
        for b in (2, 8, 16, 32, 64)
    ]
    assert all(a > b for a, b in zip(fixed, fixed[1:], strict=False)), fixed
    best = [true_optimum(ls, SearchSpace(), c, max_running_requests=64)[1] for c in LEVELS]
    assert all(a > b for a, b in zip(best, best[1:], strict=False)), best
    assert 2.0 <= best[0] <= 2.7  # "~2.3x" at batch size 1 (EAGLE-3 paper: 2.36x)


def test_no_gain_landscape_has_no_winning_configuration():
    ls = get_landscape("no-gain")
    for c in LEVELS:
        config, speedup = true_optimum(ls, SearchSpace(), c, max_running_requests=64)
        assert speedup < 1.0, (c, config, speedup)


def test_mem_tight_has_a_monotone_oom_cliff():
    ls = get_landscape("mem-tight")
    space = SearchSpace()
    verdicts = [check_memory(ls, c, max_running_requests=64).ok for c in space.iter_configs()]
    assert any(verdicts) and not all(verdicts)
    # More draft tokens at a fixed captured batch: once it fails, it keeps failing.
    for bs in (16, 32, 48, 64):
        row = [
            check_memory(
                ls, SpecConfig(num_steps=8, topk=8, num_draft_tokens=n), cuda_graph_max_bs=bs, max_running_requests=128
            ).ok
            for n in (4, 8, 16, 24, 32, 48, 64)
        ]
        assert row == sorted(row, reverse=True), (bs, row)
    # A larger captured batch at fixed draft tokens: the same.
    col = [
        check_memory(
            ls, SpecConfig(num_steps=5, topk=4, num_draft_tokens=16), cuda_graph_max_bs=bs, max_running_requests=256
        ).ok
        for bs in (8, 16, 48, 64, 128, 256)
    ]
    assert col == sorted(col, reverse=True) and col[0] and not col[-1], col
    small = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    big = SpecConfig(num_steps=8, topk=8, num_draft_tokens=64)
    assert memory_required_gb(ls, big, max_running_requests=64) > memory_required_gb(ls, small, max_running_requests=64)
    assert check_memory(ls, big, max_running_requests=64).failure == "cuda_graph"
    # A big landscape takes the same config without trouble.
    assert check_memory(get_landscape("dense-8b-h100"), big, max_running_requests=64).ok


def test_true_optimum_skips_oom_configurations():
    ls = get_landscape("mem-tight")
    config, _ = true_optimum(ls, SearchSpace(), 64, max_running_requests=64)
    assert check_memory(ls, config, max_running_requests=64).ok


def test_capture_lists_match_sglang():
    assert [len(capture_sizes(b, speculative=True)) for b in (1, 8, 16, 48, 256)] == [1, 8, 12, 23, 51]
    assert capture_sizes(20, speculative=False) == (1, 2, 4, 8, 12, 16, 20)
    assert capture_sizes(50, speculative=True)[-3:] == (44, 48, 50)  # the max is always appended
    # The list is cut at max running requests; SGLang's default 48 with spec.
    plan = graph_plan(get_landscape("dense-8b-h100"), speculative=True)
    assert plan.max_running_requests == 48 and plan.largest == 48 and len(plan.sizes) == 23


def test_padding_and_the_eager_penalty():
    ls = get_landscape("dense-8b-h100")
    cfg = chain(3)
    p9 = predict(ls, cfg, 9, cuda_graph_max_bs=16, max_running_requests=64)
    p10 = predict(ls, cfg, 10, cuda_graph_max_bs=16, max_running_requests=64)
    assert p9.padded_batch_size == 10 and p9.cycle_ms == p10.cycle_ms and p9.cuda_graph
    inside = predict(ls, cfg, 16, cuda_graph_max_bs=16, max_running_requests=64)
    eager = predict(ls, cfg, 17, cuda_graph_max_bs=16, max_running_requests=64)
    assert not eager.cuda_graph and inside.cuda_graph
    assert eager.cycle_ms / inside.cycle_ms == pytest.approx(ls.eager_penalty, rel=0.02)
    off = predict(ls, cfg, 1, disable_cuda_graph=True)
    on = predict(ls, cfg, 1)
    assert not off.cuda_graph and off.cycle_ms == pytest.approx(on.cycle_ms * ls.eager_penalty)


def test_max_running_requests_caps_the_batch():
    ls = get_landscape("dense-8b-h100")
    capped = predict(ls, chain(3), 64)  # spec default: 48 running, 16 waiting
    assert capped.batch_size == 48 and capped.max_running_requests == 48
    assert capped.output_tok_s == pytest.approx(predict(ls, chain(3), 48).output_tok_s)


def test_acceptance_tree_boost_and_draft_token_budget():
    ls = get_landscape("dense-8b-h100")
    assert accept_length(depth_acceptance(ls, 5, 1, 6)) < accept_length(depth_acceptance(ls, 5, 4, 16))
    # Only n-1 nodes are verified: depth min(k, n-1).
    assert len(depth_acceptance(ls, 8, 4, 4)) == 3
    with pytest.raises(InfeasibleConfigError):
        predict(ls, SpecConfig(num_steps=2, topk=2, num_draft_tokens=8), 1)


def test_startup_grows_with_captured_sizes_and_steps():
    ls = get_landscape("moe-pcie")
    assert startup_seconds(ls, chain(2, 8)) < startup_seconds(ls, chain(2, 48)) < startup_seconds(ls, chain(10, 48))
    assert 600 <= startup_seconds(ls, chain(10), max_running_requests=48) <= 900  # "10-15 min" (§1)


def test_noise_is_deterministic_from_the_seed():
    ls = get_landscape("moe-pcie")
    rates = depth_acceptance(ls, 5, 1, 6)
    noise = NoiseModel()

    def draws(seed: int) -> list[float]:
        rng = random.Random(seed)
        return [sample_accept_tokens(rates, rng) for _ in range(50)] + [noise.request_factor(rng) for _ in range(5)]

    assert draws(7) == draws(7) and draws(7) != draws(8)
    assert noise.host_factor(1, "gpu-a") == noise.host_factor(1, "gpu-a") != noise.host_factor(1, "gpu-b")
    assert noise.drift_factor(1, "gpu-a", 1000.0) == noise.drift_factor(1, "gpu-a", 1000.0)
    assert 0.9 < noise.host_factor(1, "gpu-a") < 1.1
    off = NoiseModel(sigma=0.0)
    assert off.host_factor(1, "a") == off.drift_factor(1, "a", 5.0) == off.request_factor(random.Random(1)) == 1.0
    # Sampled acceptance converges on the model; the noise-free accumulator hits it exactly.
    rng = random.Random(3)
    mean = sum(sample_accept_tokens(rates, rng) for _ in range(20000)) / 20000
    assert mean == pytest.approx(accept_length(rates), rel=0.02)
    acc = AcceptAccumulator(rates)
    assert sum(acc.next() for _ in range(1000)) / 1000 == pytest.approx(accept_length(rates), abs=0.002)


def test_landscape_lookup():
    assert set(LANDSCAPES) >= {"moe-pcie", "dense-8b-h100", "no-gain", "mem-tight"}
    assert get_landscape("/models/moe-pcie/").name == "moe-pcie"
    with pytest.raises(UnknownLandscapeError, match="Known: "):
        get_landscape("sim/llama-70b")
