"""`python -m api.cli ...`: the same as the `spectune` console script (without the worker-only check)."""

from api.cli import main

main()
