"""Incremental server-sent-events decoding, tuned for SGLang's ``/generate`` stream.

SGLang sends one ``data: {json}`` line per event followed by a blank line, and ends the stream
with ``data: [DONE]`` (docs/sglang.md §7).  The decoder works on raw bytes as they arrive
from the socket, splits on newlines with ``bytes.split`` (C speed) and keeps only the unfinished
tail between reads, so its cost per event is a few hundred nanoseconds plus the JSON parse done
by the caller.  It accepts ``\\n`` and ``\\r\\n`` line ends, ignores comments and non-``data``
fields, and joins multi-line ``data`` fields with ``\\n`` as the SSE specification says.
"""

from __future__ import annotations

DONE = b"[DONE]"

# A line this long without a newline means the peer is not an SSE server (or is broken); bounding
# the buffer keeps a bad server from exhausting the worker's memory.
MAX_LINE_BYTES = 64 * 1024 * 1024


class SSEDecodeError(ValueError):
    """The byte stream is not valid server-sent events."""


class SSEDecoder:
    """Feed raw bytes, get back the ``data`` payload of each completed event (as bytes)."""

    __slots__ = ("_tail", "_data", "_max_line")

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._tail = b""
        self._data: list[bytes] = []
        self._max_line = max_line_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        """Decode ``chunk``; return the payloads of the events it completed, in order."""
        buf = self._tail + chunk if self._tail else chunk
        lines = buf.split(b"\n")
        self._tail = lines.pop()
        if len(self._tail) > self._max_line:
            raise SSEDecodeError(f"an SSE line exceeded {self._max_line} bytes without a newline")
        events: list[bytes] = []
        data = self._data
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if data:
                    events.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data.clear()
            elif line.startswith(b"data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(b" ") else value)
            # Comments (":...") and other fields (event:, id:, retry:) carry nothing we use.
        return events

    def close(self) -> list[bytes]:
        """End of stream: return a last event that was not followed by a blank line, if any."""
        events: list[bytes] = []
        if self._tail:
            events.extend(self.feed(b"\n"))
        if self._data:
            events.append(b"\n".join(self._data))
            self._data.clear()
        return events
