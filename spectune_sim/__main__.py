"""`python -m spectune_sim <SGLang launch flags>`: the simulated SGLang server."""

import sys

from spectune_sim.server import main

sys.exit(main())
