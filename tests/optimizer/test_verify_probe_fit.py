"""The baseline's verify probe as data for the performance model (issue 31 item 2).

perf_model.fit's `shapes` adds a residual per probe point to the cost half; without shapes the fit
is the trials' alone, exactly as before the probe was read.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from optimizer import conductor
from optimizer.perf_model import Candidates, Observation, fit, probe_rows
from optimizer.space import SpecConfig
from optimizer.verify_probe import ShapePoint, VerifyShape, latest_shapes, shapes_key

OBS = [
    Observation(3, 1, 4, 8, 2.6, 1.42, host="h0"),
    Observation(5, 1, 6, 8, 3.1, 1.71, host="h0"),
    Observation(4, 4, 8, 8, 3.3, 1.80, host="h1"),
    Observation(3, 1, 4, 1, 2.6, 1.30, host="h1"),
    Observation(6, 4, 16, 1, 3.6, 1.75, host="h0"),
]
# `fit(OBS, 10)` as main computed it before the probe was read (commit 209da4b).
MAIN_COST = [
    0.07448063513635385,
    0.040115394595465745,
    0.026514280297565595,
    0.009752450813563112,
    1.036604152948133e-15,
]
MAIN_LOGITS = [0.8773685988239257, 1.0658353811604686, 1.1273916317138195, 0.8996279829378265, 0.2014610287480363]
MAIN_LOGITS += [-0.09051611395537577]


def _shape(ratios: dict[int, float], batch: int = 16, sd: float = 0.01) -> VerifyShape:
    pts = tuple(ShapePoint(k, r, sd * r) for k, r in sorted(ratios.items()))
    return VerifyShape(points={batch: pts}, overhead_s={batch: 0.0}, decode_s={batch: 0.02})


# Past 64 tokens in one forward (4 per request at batch 16) each doubling costs nearly twice: a
# tile step / expert saturation that chains of at most 6 tokens at batch 16 never reach.
STEEP = _shape({1: 1.0, 2: 1.05, 4: 1.1, 8: 2.0, 16: 3.6, 32: 6.8, 64: 13.0})
# Where the probe shows only the k = 1 point: nothing about the slope.
NO_SLOPE = _shape({1: 1.0})


def test_no_shapes_fit_exactly_as_before() -> None:
    # Catches any change the probe rows make to a fit that has none: with no shapes, empty ones,
    # or ones with only k = 1 the fit is the same, bit for bit, on this machine; and it is the fit
    # main made before the probe existed, up to what another machine's BLAS and CPU move in a
    # solver's last iterations (bit for bit against stored values failed on a new box: 3e-6).
    fits = [fit(OBS, 10, shapes=shapes) for shapes in (None, {}, {"h0": NO_SLOPE})]
    first = fits[0]
    assert first is not None
    for m in fits:
        assert m is not None
        assert m.cost.tolist() == first.cost.tolist()
        assert m.logits.tolist() == first.logits.tolist()
        assert m.knee == 6.0
    assert first.cost.tolist() == pytest.approx(MAIN_COST, rel=1e-4, abs=1e-9)
    assert first.logits.tolist() == pytest.approx(MAIN_LOGITS, rel=1e-4, abs=1e-9)
    assert len(probe_rows({"h0": NO_SLOPE})) == 0


def _chains_at(batch: int) -> list[Observation]:
    # Chains only (topk 1, 2-6 tokens): the trials say nothing about a forward over hundreds of tokens.
    out = []
    for steps in (1, 2, 3, 4, 5):
        n = steps + 1
        al = 1.0 + sum(0.75**i for i in range(1, steps + 1))
        ratio = steps * 0.06 + 1.0 + 0.012 * (batch * n - batch) / batch + 0.05
        out.append(Observation(steps, 1, n, batch, al, ratio, host="h0"))
    return out


def test_steep_probe_predicts_a_wide_tree_slower() -> None:
    obs = _chains_at(16)
    wide = Candidates.of([SpecConfig(num_steps=5, topk=8, num_draft_tokens=64)])
    chain = Candidates.of([SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)])
    plain, probed = fit(obs, 10), fit(obs, 10, shapes={"h0": STEEP})
    assert plain is not None and probed is not None
    wide_plain = float(plain.predict_log_speedup(wide, [16], [1.0], with_sd=False)[0][0])
    wide_probed = float(probed.predict_log_speedup(wide, [16], [1.0], with_sd=False)[0][0])
    # The probe's 13x at 64 tokens per request, against the prior's few-% slope: far slower.
    assert wide_probed < wide_plain - 0.3
    # The chains the trials measured stay where they were (within a few %).
    chain_plain = float(plain.predict_log_speedup(chain, [16], [1.0], with_sd=False)[0][0])
    chain_probed = float(probed.predict_log_speedup(chain, [16], [1.0], with_sd=False)[0][0])
    assert abs(chain_probed - chain_plain) < 0.05
    # And the model now ranks the chain above the wide tree, which it did not without the probe.
    assert wide_plain > chain_plain
    assert wide_probed < chain_probed


def test_probe_rows_carry_the_floor() -> None:
    rows = probe_rows({"h0": STEEP, "h1": STEEP})
    assert len(rows) == 12  # two hosts x six counts beyond k = 1
    assert np.all(rows.sd >= 0.03)
    assert np.all(rows.batch == 16.0)


def _base(i: int, host: str, minutes: int, probe: dict[str, object] | None, valid: bool = True) -> conductor.Baseline:
    at = datetime(2026, 12, 1, tzinfo=UTC) + timedelta(minutes=minutes)
    levels = [{"concurrency": 4, "output_tok_s": 200.0}]
    return conductor.Baseline(i, host, at, {4: 200.0}, levels=levels, valid=valid, verify_probe=probe)


def _probe(slope: float) -> dict[str, object]:
    pts = [
        {
            "concurrency": 4,
            "tokens": k,
            "seconds": 0.025 + slope * (k - 1),
            "seconds_runs": [0.025 + slope * (k - 1)] * 3,
        }
        for k in (1, 2, 4, 8)
    ]
    return {"points": pts, "prefix_tokens": 256, "spent_s": 1.0}


def test_latest_shapes_take_each_hosts_newest_valid_probe() -> None:
    baselines = [
        _base(0, "h0", 0, _probe(0.001)),
        _base(1, "h0", 10, _probe(0.004)),  # h0's newest probe
        _base(2, "h0", 20, None),  # newer, but measured by a worker without the probe
        _base(3, "h1", 0, _probe(0.002)),
        _base(4, "h1", 30, _probe(0.009), valid=False),  # under a previous token: not h1's
    ]
    shapes = latest_shapes(baselines)
    assert sorted(shapes) == ["h0", "h1"]
    r0, r1 = shapes["h0"].ratio(4, 8), shapes["h1"].ratio(4, 8)
    assert r0 is not None and r1 is not None
    # decode step 4 / 200 = 0.02 s; o_b = 0.005: h0 (0.025 + 0.028 - 0.005) / 0.02 = 2.4.
    assert abs(r0 - 2.4) < 1e-9
    assert abs(r1 - (0.025 + 0.014 - 0.005) / 0.02) < 1e-9
    snap_key = shapes_key(shapes)
    assert snap_key != shapes_key(latest_shapes(baselines[:1] + baselines[3:4]))
    assert shapes_key({}) == shapes_key(None) == ""
