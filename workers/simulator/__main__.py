"""`python -m workers.simulator <SGLang launch flags>`: the simulated SGLang server."""

import sys

from workers.simulator.server import main

sys.exit(main())
