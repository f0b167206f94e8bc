"""The simulator states SGLang's rules on its own (spectune_sim/rules.py) and imports nothing of the
tuner; here both statements are checked against each other on a sample.  Two statements that agree
are what make the double useful: a bug in one shows up as a disagreement, not as a copy."""

from __future__ import annotations

from pathlib import Path

import pytest

import spectune_sim
import workers.lifeline
from optimizer.sglang import ServerSettings, build_server_args, flag_set_for
from optimizer.space import SearchSpace, SpecConfig, max_draft_tokens
from spectune_sim import lifeline as sim_lifeline
from spectune_sim.args import build_parser, resolve
from spectune_sim.landscapes import get_landscape
from spectune_sim.rules import DraftTree, TreeGrid, draft_token_limit, graph_flags
from tests.support.source_walk import imported_modules

FORBIDDEN = ("optimizer", "api", "workers")
VERSIONS = ("0.5.10", "0.5.13", "0.5.15", "0.5.16", "0.5.19", "0.5.20", "0.5.23", "0.6.0")
SAMPLE = [
    SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
    for s, k, n in [(1, 1, 2), (3, 1, 4), (3, 1, 9), (5, 4, 8), (3, 2, 10), (5, 8, 49), (2, 8, 64), (6, 2, 7)]
]


def test_the_simulator_imports_nothing_of_the_tuner() -> None:
    package = Path(spectune_sim.__file__).parent
    modules = sorted(package.rglob("*.py"))
    assert len(modules) >= 8  # the walk sees the package (args, engine, model, server, rules, ...)
    offending = {
        f"{path.relative_to(package)}: {name}"
        for path in modules
        for name in imported_modules(path)
        if name.split(".")[0] in FORBIDDEN
    }
    assert not offending, f"spectune_sim must state SGLang's rules itself: {sorted(offending)}"


def test_the_import_walk_would_see_a_forbidden_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from optimizer.space import max_draft_tokens\n    import workers.lifeline\n")
    assert {"optimizer.space", "workers.lifeline"} <= imported_modules(probe)


@pytest.mark.parametrize("version", VERSIONS)
def test_both_name_the_same_cuda_graph_flag_generation(version: str) -> None:
    assert graph_flags(version).value == flag_set_for(version).value


def test_both_bound_the_draft_tree_alike() -> None:
    for steps in range(1, 13):
        for topk in range(1, 11):
            assert draft_token_limit(steps, topk) == max_draft_tokens(steps, topk), (steps, topk)


def test_both_rewrite_and_list_the_same_trees() -> None:
    for config in SAMPLE:
        tree, canon = DraftTree.of(config), config.canonical()
        assert (tree.num_steps, tree.topk, tree.num_draft_tokens) == (
            canon.num_steps,
            canon.topk,
            canon.num_draft_tokens,
        )
    simulated = [(t.num_steps, t.topk, t.num_draft_tokens) for t in TreeGrid().iter_configs()]
    tuned = [(c.num_steps, c.topk, c.num_draft_tokens) for c in SearchSpace().iter_configs()]
    assert simulated == tuned and len(simulated) > 100


@pytest.mark.parametrize("version", VERSIONS)
def test_the_simulator_parses_and_resolves_what_the_tuner_launches(version: str) -> None:
    landscape = get_landscape("/models/moe-pcie")
    for i, config in enumerate(SAMPLE):
        graphs = {"cuda_graph_bs": (1, 2, 4, 8)} if i % 2 else {"cuda_graph_max_bs": 16}
        settings = ServerSettings(
            target="moe-pcie", draft="moe-pcie-eagle3", max_running_requests=8, speculative=config, **graphs
        )
        argv = build_server_args(settings, version=version, model_path="/models/moe-pcie", draft_model_path="/d")
        resolved = resolve(build_parser(version).parse_args(argv), landscape, version)
        canon = config.canonical()
        assert (resolved.num_steps, resolved.topk, resolved.num_draft_tokens) == (
            canon.num_steps,
            canon.topk,
            canon.num_draft_tokens,
        )
        assert resolved.cuda_graph_max_bs == (8 if i % 2 else 16) and resolved.max_running_requests == 8


def test_both_use_the_same_exit_with_parent_variable() -> None:
    assert sim_lifeline.ENV == workers.lifeline.ENV
