"""The calibrated simulated SGLang engine.

* `spectune_sim.model` / `landscapes`: the pure performance model (predict, memory, start-up,
  true optimum) and the named host+model profiles.
* `python -m spectune_sim <SGLang launch flags>`: the server process (`server.py`).
* `python -m spectune_sim.landscapes`: per-landscape baseline and true-optimum table.

Import from the submodules: this package imports nothing, so `python -m` of a submodule and the
child process start without loading the model.
"""
