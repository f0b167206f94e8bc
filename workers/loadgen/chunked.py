"""Incremental decoding of HTTP/1.1 ``Transfer-Encoding: chunked`` bodies (RFC 9112 §7.1)."""

from __future__ import annotations


class ChunkedError(ValueError):
    """The body is not valid chunked transfer coding."""


_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)


class ChunkedDecoder:
    """Incremental decoder of HTTP/1.1 ``Transfer-Encoding: chunked`` bodies."""

    __slots__ = ("_buf", "_state", "_need")

    def __init__(self) -> None:
        self._buf = b""
        self._state = _SIZE
        self._need = 0  # data bytes of the current chunk still to come

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, data: bytes) -> bytes:
        """Return the payload bytes that ``data`` completes (possibly empty)."""
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        pos, end = 0, len(buf)
        while pos < end:  # every branch consumes bytes or breaks
            state = self._state
            if state == _DATA:
                take = min(self._need, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._need -= take
                if self._need:
                    break
                self._state = _DATA_END
            elif state == _DATA_END:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ChunkedError("malformed chunked body: chunk data not followed by CRLF")
                pos += 2
                self._state = _SIZE
            elif state == _SIZE or state == _TRAILER:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > 4096:
                        raise ChunkedError("malformed chunked body: line too long")
                    break
                line = buf[pos:eol]
                pos = eol + 2
                if state == _TRAILER:
                    if not line:
                        self._state = _DONE
                    continue
                size_field = line.split(b";", 1)[0].strip()
                try:
                    size = int(size_field, 16)
                except ValueError:
                    raise ChunkedError(f"malformed chunked body: bad chunk size {size_field!r}") from None
                if size:
                    self._need = size
                    self._state = _DATA
                else:
                    self._state = _TRAILER  # last chunk: optional trailers, then an empty line
            else:  # _DONE: anything after the body belongs to no request
                raise ChunkedError("the server sent data after the end of the chunked body")
        self._buf = buf[pos:]
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)
