"""SGLang's EAGLE-3 rules in the search space, the canonical form, and the argv per version."""

from __future__ import annotations

import pytest

from optimizer.deploy import deployment_settings
from optimizer.errors import SpecError
from optimizer.plan import baseline_key, server_settings, workload_doc
from optimizer.sglang import FlagSet, ServerSettings, build_server_args, flag_set_for, launch_command
from optimizer.space import SearchSpace, SpecConfig, max_draft_tokens, params_of
from optimizer.spec import parse_spec


def test_topk_one_forces_draft_tokens_to_steps_plus_one() -> None:
    a = SpecConfig(num_steps=3, topk=1, num_draft_tokens=8)
    b = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    assert a.canonical() == b.canonical() == b
    assert a.key == b.key == "s3-k1-n4-bsauto"


def test_draft_tokens_over_the_tree_are_rejected() -> None:
    # SGLang's own bound: draft tokens - 1 <= topk + (steps - 1) * topk^2.
    assert max_draft_tokens(2, 4) == 21
    assert max_draft_tokens(3, 1) == 4
    SpecConfig(num_steps=2, topk=4, num_draft_tokens=21).check()
    with pytest.raises(SpecError, match=r"draft tokens - 1 <= topk \+ \(steps - 1\) \* topk\^2, so at most 21"):
        SpecConfig(num_steps=2, topk=4, num_draft_tokens=22).check()


def test_trees_the_bench_script_leaves_out_are_in_the_default_space() -> None:
    """3/2/10 and 5/8/49 exceed bench_speculative's steps*topk+1 but SGLang fills them."""
    space = SearchSpace()
    keys = {c.key for c in space.iter_configs()}
    for steps, topk, ndt in ((3, 2, 10), (5, 8, 49), (3, 2, 11), (2, 8, 64)):
        c = SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=ndt)
        assert c.check() == c
        assert space.contains(c)
        assert c.key in keys
        assert space.config_from_params(params_of(c)) == c
    # One over the bound is not: 3/2/12 needs 11 candidates of the 2 + 2*4 = 10 there are.
    assert not space.contains(SpecConfig(num_steps=3, topk=2, num_draft_tokens=12))
    assert "s3-k2-n12-bsauto" not in keys


def test_dominated_trees_are_left_out_of_the_space() -> None:
    """With topk > 1 steps beyond draft tokens - 1 only add draft passes (10/8/3 is 2/8/3, slower)."""
    space = SearchSpace()
    slow = SpecConfig(num_steps=10, topk=8, num_draft_tokens=3)
    assert slow.dominated and slow.check() == slow  # SGLang runs it
    assert not space.contains(slow)
    assert all(not c.dominated for c in space.iter_configs())
    assert space.config_from_params({"num_steps": 10, "topk": 8, "num_draft_tokens": 3}) == SpecConfig(
        num_steps=2, topk=8, num_draft_tokens=3
    )


def test_iter_configs_is_the_valid_canonical_set_once_each() -> None:
    space = SearchSpace.model_validate(
        {"num_steps": {"low": 1, "high": 4}, "topk": [1, 2, 4], "num_draft_tokens": {"low": 2, "high": 8}}
    )
    configs = list(space.iter_configs())
    keys = [c.key for c in configs]
    assert len(keys) == len(set(keys))
    for c in configs:
        assert c.check() == c
        assert space.contains(c)
    chains = [c for c in configs if c.topk == 1]
    assert [c.num_draft_tokens for c in chains] == [2, 3, 4, 5]
    # Brute force agrees with the enumeration.
    brute = set()
    for steps in range(1, 5):
        for topk in (1, 2, 4):
            for ndt in range(2, 9):
                try:
                    c = SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=ndt).check()
                except SpecError:
                    continue
                if topk == 1 or (2 <= c.num_draft_tokens <= 8 and not c.dominated):
                    brute.add(c.key)
    assert brute == set(keys)


def test_params_round_trip_and_clamp() -> None:
    space = SearchSpace()
    for c in list(space.iter_configs())[::37]:
        assert space.config_from_params(params_of(c)) == c
    # A tree asking for more draft tokens than it can fill runs at the limit.
    clamped = space.config_from_params({"num_steps": 2, "topk": 2, "num_draft_tokens": 40})
    assert clamped.num_draft_tokens == 7
    assert "num_draft_tokens" not in params_of(SpecConfig(num_steps=4, topk=1, num_draft_tokens=5))


def test_default_space_validates_and_rejects_impossible_ranges() -> None:
    SearchSpace().validate_rules()
    with pytest.raises(SpecError) as e:
        SearchSpace.model_validate(
            {"num_steps": {"low": 1, "high": 2}, "topk": [2], "num_draft_tokens": {"low": 2, "high": 9}}
        ).validate_rules()
    assert e.value.field == "search_space.num_draft_tokens"


@pytest.mark.parametrize(
    ("version", "flags"),
    [("0.5.10", FlagSet.LEGACY), ("0.5.13", FlagSet.LEGACY), ("0.5.16", FlagSet.V0516), ("0.5.19", FlagSet.V0516),
     ("0.5.20", FlagSet.MODERN), ("0.5.23", FlagSet.MODERN), ("0.6.0", FlagSet.MODERN)],
)  # fmt: skip
def test_flag_set_per_version(version: str, flags: FlagSet) -> None:
    assert flag_set_for(version) is flags


def test_server_args_for_trial_and_baseline() -> None:
    spec = parse_spec({"name": "x", "model": {"target": "t", "draft": "d"}, "workload": {"concurrency": [1, 8]}})
    cfg = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    trial = server_settings(spec, cfg)
    base = server_settings(spec, None)
    assert base == trial.baseline()
    args = build_server_args(trial, version="0.5.23", model_path="/m/t", draft_model_path="/m/d")
    assert args[args.index("--max-running-requests") + 1] == "8"
    # While tuning, graphs are captured for the workload's levels only (shorter start-up).
    i = args.index("--cuda-graph-bs-decode")
    assert args[i + 1 : i + 3] == ["1", "8"] and "--cuda-graph-max-bs-decode" not in args
    assert "--cuda-graph-max-bs" not in args
    # The server to deploy captures every size up to the largest measured load (no serving section:
    # it admits only what was measured, issue 17).
    deploy = build_server_args(
        deployment_settings(spec, cfg)[0], version="0.5.23", model_path="/m/t", draft_model_path="/m/d"
    )
    assert deploy[deploy.index("--cuda-graph-max-bs-decode") + 1] == "8" and "--cuda-graph-bs-decode" not in deploy
    assert args[args.index("--speculative-draft-model-path") + 1] == "/m/d"
    legacy = build_server_args(base, version="0.5.13", model_path="/m/t", draft_model_path=None)
    assert "--cuda-graph-bs" in legacy and not any(a.startswith("--speculative") for a in legacy)
    assert "--attention-backend" in legacy
    line = launch_command(trial)
    assert line.startswith("python -m sglang.launch_server --model-path t")


def test_baseline_key_depends_on_server_and_workload_only() -> None:
    a = parse_spec({"name": "a", "model": {"target": "t", "draft": "d"}})
    b = parse_spec({"name": "b", "model": {"target": "t", "draft": "d"}, "sampler": "random"})
    c = parse_spec({"name": "c", "model": {"target": "t", "draft": "d"}, "workload": {"output_len": 512}})
    assert baseline_key(a) == baseline_key(b) != baseline_key(c)
    # Workload fields added later (datasets, lengths, open loop) leave the keys of studies stored
    # before them as they were: the same key as before issue 19, so their baselines still count.
    assert baseline_key(a) == "0704bd9f405dd707a2b0dac7b4608304"
    d = parse_spec({"name": "d", "model": {"target": "t", "draft": "d"}, "workload": {"request_rate": 2.0}})
    assert baseline_key(d) != baseline_key(a)
    # Leases carry the same form: a worker from before these fields still reads a plain workload.
    assert set(workload_doc(a.workload)) == {
        "prompts", "output_len", "num_prompts", "concurrency", "warmup_requests", "repeats", "temperature", "ignore_eos",
    }  # fmt: skip
    assert workload_doc(d.workload)["request_rate"] == 2.0


def test_server_settings_is_frozen() -> None:
    s = ServerSettings(target="t", max_running_requests=1)
    with pytest.raises(ValueError):
        s.tp_size = 2  # type: ignore[misc]


def test_spec_validator_accepts_the_server_bound_and_refuses_beyond_it() -> None:
    base = {"name": "bound", "model": {"target": "t", "draft": "d"}}
    ok = parse_spec(
        base
        | {
            "warm_start": [
                {"num_steps": 3, "topk": 2, "num_draft_tokens": 10},
                {"num_steps": 5, "topk": 8, "num_draft_tokens": 49},
            ]
        }
    )
    assert [c.key for c in ok.warm_start] == ["s3-k2-n10-bsauto", "s5-k8-n49-bsauto"]
    with pytest.raises(SpecError) as e:
        parse_spec(base | {"warm_start": [{"num_steps": 3, "topk": 2, "num_draft_tokens": 12}]})
    assert e.value.field == "warm_start.0.num_draft_tokens"
    assert "draft tokens - 1 <= topk + (steps - 1) * topk^2, so at most 11" in e.value.message
    with pytest.raises(SpecError) as e:
        parse_spec(
            base
            | {
                "search_space": {
                    "num_steps": {"low": 1, "high": 3},
                    "topk": [2],
                    "num_draft_tokens": {"low": 2, "high": 12},
                }
            }
        )
    assert e.value.field == "search_space.num_draft_tokens"
    assert "at most 11 draft tokens" in e.value.message
