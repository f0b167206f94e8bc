"""The worker adds passes on the warm server for a confirm lease's Resolve order (issue 17 item 4)."""

from __future__ import annotations

import itertools

from tests.api.test_resolve_orders import BASE, _level, _order
from tests.workers import test_agent as agent_tests

fake_api = agent_tests.api  # the scripted lease API on 127.0.0.1 (a fixture, defined once there)


def test_the_worker_adds_passes_on_the_same_warm_server_and_reports_them(tmp_path, fake_api):  # type: ignore[no-untyped-def]
    """The agent's glue: a confirm lease with an order gets extra passes without a relaunch.

    The server is the real simulated engine; the measurements are scripted (a 3% gain whose first
    three passes straddle 1.01), so the test knows when the interval resolves.
    """
    from tests.support.helpers import wait_for
    from tests.workers.test_agent import lease_body, running_agent, write_config

    fake, server = fake_api
    order = _order(1e-5).model_dump(mode="json")
    fake.queue = [
        lease_body(
            "C-1",
            kind="confirm",
            resolve=order | {"levels": [1], "baseline_runs": {"1": BASE}},
            workload={"concurrency": [1], "num_prompts": 2, "output_len": 8, "warmup_requests": 0, "repeats": 3},
        )
    ]
    calls: list[tuple[list[int], int, str]] = []
    runs = itertools.cycle([1050.0, 1010.0, 1030.0])

    def scripted(base_url, workload, prompts, **kw):  # type: ignore[no-untyped-def]
        calls.append((list(workload.concurrency), workload.repeats, base_url))
        out = [_level(c, [next(runs) for _ in range(workload.repeats)]) for c in workload.concurrency]
        if kw.get("on_level") is not None:
            for i, m in enumerate(out):
                kw["on_level"](i, m)
        return out

    with running_agent(write_config(tmp_path, server.url)) as (agent, _):
        agent._run_workload = scripted
        wait_for("the confirmation's report", lambda: "C-1" in fake.completed, 120)
    report = fake.reports()["C-1"]
    assert report.outcome == "ok" and report.metrics is not None
    assert report.metrics.extra_passes > 0 and report.metrics.extra_passes_note == "resolved"
    level = report.metrics.levels[0]
    assert len(level.output_tok_s_runs) == 3 + report.metrics.extra_passes
    # Every extra pass ran on the server the lease launched: one launch, one URL.
    assert len(calls) >= 2 and len({url for _, _, url in calls}) == 1
    assert all(c == ([1], 3) for c in [(cs, k) for cs, k, _ in calls[1:]])
