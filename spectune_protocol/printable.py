"""Text that crossed the wire, made safe to print on one line of a terminal or a log.

Both sides print text the other side sent: the CLI prints failure messages a worker reported
(`spectune study show`), the worker logs study names and messages from the API.  A control
character there is an attack on the reader: ESC sequences rewrite the terminal (hide lines,
retitle windows, fake a prompt), and a newline forges a whole log line.  `printable` writes every
such character as a visible escape instead.
"""

from __future__ import annotations

import re

# C0 controls (newline and tab included: a message is one line), DEL, C1 controls, and the
# bidirectional overrides that make text read in another order than it is stored.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """`text` with every control character written as `\\xNN` (`\\n` kept when `keep_newlines`)."""
    if keep_newlines:
        return "\n".join(_CONTROL.sub(_escape, line) for line in text.split("\n"))
    return _CONTROL.sub(_escape, text)
