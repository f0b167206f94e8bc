"""The calibrated simulated SGLang engine.

* `workers.simulator.model` / `landscapes`: the pure performance model (predict, memory, start-up,
  true optimum) and the named host+model profiles.
* `python -m workers.simulator <SGLang launch flags>`: the server process (`server.py`).
* `python -m workers.simulator.landscapes`: per-landscape baseline and true-optimum table.

Import from the submodules: this package imports nothing, so `python -m` of a submodule and the
child process start without loading the model.
"""
