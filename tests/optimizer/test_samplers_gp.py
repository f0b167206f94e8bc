"""The `gp` sampler needs torch, an optional extra: refused at creation without it, never a dead study."""

from __future__ import annotations

import optuna
import pytest

from optimizer import samplers
from optimizer.errors import SpecError
from optimizer.spec import parse_spec


def test_without_torch_a_gp_study_is_refused_and_a_stored_one_still_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_spec({"name": "g", "model": {"target": "t", "draft": "d"}, "sampler": "gp"})
    assert isinstance(samplers.make_sampler(spec, 1), optuna.samplers.GPSampler)  # torch is here (make setup)
    monkeypatch.setattr(samplers, "gp_available", lambda: False)  # an API host with the server extra only
    with pytest.raises(SpecError) as e:
        samplers.check_sampler_installed(spec)
    assert e.value.field == "sampler" and "[server,gp]" in e.value.message
    # A gp study stored by a process that had torch keeps handing out work (TPE asks instead).
    assert isinstance(samplers.make_sampler(spec, 1), optuna.samplers.TPESampler)
