"""The worker's async load generator for SGLang's native ``/generate`` endpoint.

``run_workload`` measures every concurrency level of a study's workload; ``run_level`` measures
one; ``load_prompts`` resolves the workload's prompt set.  See ``runner.py`` for the request
schedule, ``request.py`` for how tokens are timed and ``shards.py`` for how a high-concurrency
level is spread over several generator processes.
"""

from workers.loadgen.errors import LoadgenCancelled, LoadgenError
from workers.loadgen.prompts import builtin_sets, load_prompts
from workers.loadgen.runner import make_client, run_level, run_workload

__all__ = [
    "LoadgenCancelled",
    "LoadgenError",
    "builtin_sets",
    "load_prompts",
    "make_client",
    "run_level",
    "run_workload",
]
