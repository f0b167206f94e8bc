"""`python -m spectune_sim.landscapes`: the per-landscape table of baselines and true optima
(spectune_sim.report).  Here, not in the package itself: the report imports the landscapes."""

from spectune_sim.report import main

main()
