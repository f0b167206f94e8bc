"""Proving the printed command (issue 17 items 1-2): the envelopes a confirmation launches."""

from __future__ import annotations

from typing import Any

from optimizer.deploy import deployment_envelopes, deployment_failure, deployment_settings
from optimizer.space import SpecConfig
from optimizer.spec import parse_spec
from spectune_sim.landscapes import get_landscape
from spectune_sim.model import check_memory

BEST = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)


def spec(**extra: Any) -> Any:
    doc: dict[str, Any] = {"name": "p", "model": {"target": "t", "draft": "d"}, "workload": {"concurrency": [1, 16]}}
    return parse_spec(doc | extra)


def _starts(settings: Any) -> bool:
    return check_memory(
        get_landscape("deploy-tight"),
        settings.speculative,
        max_running_requests=settings.max_running_requests,
        cuda_graph_max_bs=settings.cuda_graph_max_bs,
        cuda_graph_bs=settings.cuda_graph_bs,
    ).ok


def test_the_printed_envelope_comes_first_then_smaller_graphs_where_serving_allows() -> None:
    s = spec(serving={"max_running_requests": 48})
    envs = deployment_envelopes(s, BEST)
    assert envs[0].settings == deployment_settings(s, BEST)[0] and envs[0].note == ""
    assert [e.settings.cuda_graph_max_bs for e in envs] == [48, 16, 16]
    assert envs[2].settings.cuda_graph_bs == (1, 16)
    # Max running requests is the load the user asked for: never lowered.
    assert {e.settings.max_running_requests for e in envs} == {48}
    assert "largest measured level" in envs[1].note
    # A pinned max_batch leaves nothing to lower.
    assert len(deployment_envelopes(spec(serving={"max_running_requests": 48, "max_batch": 48}), BEST)) == 1
    # No serving section: the printed command is already sized to the measured loads.
    plain = deployment_envelopes(spec(), BEST)
    assert [e.settings.cuda_graph_max_bs for e in plain] == [16, 16] and plain[1].settings.cuda_graph_bs == (1, 16)


def test_on_the_deploy_tight_engine_the_tuning_envelope_fits_and_the_printed_one_does_not() -> None:
    s = spec(serving={"max_running_requests": 48})
    envs = deployment_envelopes(s, BEST)
    assert not _starts(envs[0].settings), "graphs up to 48 do not fit"
    assert _starts(envs[1].settings), "graphs up to the largest measured level do"
    from optimizer.plan import server_settings

    assert _starts(server_settings(s, BEST)), "the search's envelope fits"


def test_a_failed_start_is_named_in_the_users_terms() -> None:
    assert "capturing CUDA graphs" in deployment_failure("oom", "Capture cuda graph failed: CUDA out of memory")
    assert "KV cache" in deployment_failure("oom", "Not enough memory for the KV pool")
    assert "time-out" in deployment_failure("launch_timeout", "not ready in 600 s")


def test_a_graph_envelope_that_ran_out_of_memory_is_not_tried_again_for_a_larger_configuration() -> None:
    from optimizer.deploy import envelopes_to_try

    s = spec(serving={"max_running_requests": 48})
    small = SpecConfig(num_steps=2, topk=1, num_draft_tokens=3)
    assert [t for t, _ in envelopes_to_try(s, BEST)] == [0, 1, 2]
    failed = [(small, 0)]
    # 3/1/4 needs at least the graph memory 2/1/3 ran out of in tier 0: start at tier 1.
    assert [t for t, _ in envelopes_to_try(s, BEST, failed)] == [1, 2]
    # A smaller configuration is still tried in the printed envelope.
    assert [t for t, _ in envelopes_to_try(s, SpecConfig(num_steps=1, topk=1, num_draft_tokens=2), failed)] == [0, 1, 2]
