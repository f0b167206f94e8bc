"""Stand-in for SGLang's scheduler/detokenizer subprocess.

It does nothing but live: it holds the read end of a pipe whose write end only the server
holds, so it exits as soon as the server closes the pipe or dies in any way (even SIGKILL or a
segfault), and a launcher that kills the process group must reap it too.
"""

from __future__ import annotations

import sys


def main() -> int:
    while sys.stdin.buffer.read(4096):
        pass  # nothing is ever written; EOF means the parent is gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
