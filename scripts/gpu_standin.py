"""A GPU-holding stand-in for an SGLang server, to check the launcher's stop and NVML release wait.

Run as a module, the way the launcher runs engines (`python -m scripts.gpu_standin <SGLang flags>`,
with the repository root on PYTHONPATH; scripts/check_gpu_release.py does that).  It:

* accepts SGLang's launch flags, reads --host/--port (and echoes a few others in /server_info),
  ignores the rest;
* allocates SPECTUNE_STANDIN_GIB GiB of GPU memory with torch (default 4; 0 = no GPU, no torch:
  a CPU stand-in for trying the launcher anywhere);
* spawns a child process (same process group, as SGLang's scheduler is) that allocates
  SPECTUNE_STANDIN_CHILD_GIB GiB (default 2) and waits for its parent to go;
* then opens the HTTP port: /health, /health_generate and /ready answer 200, /server_info (and
  /get_server_info) a minimal JSON;
* exits on SIGTERM, unless SPECTUNE_STANDIN_IGNORE_SIGTERM=1 (parent and child then ignore it, so
  the launcher must escalate to SIGKILL).  SPECTUNE_STANDIN_MAX_S (default 3600) bounds its life.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_GIB = 1 << 30
_CHILD_FLAG = "--standin-child"
_CHILD_READY_TIMEOUT_S = 120.0


def _log(message: str) -> None:
    # stdout is the server log the launcher captures, as SGLang's is.
    print(f"[gpu-standin pid {os.getpid()}] {message}", flush=True)  # noqa: T201


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        return default if raw is None else float(raw)
    except ValueError:
        _log(f"ignoring {name}={raw!r}: not a number")
        return default


def _allocate(gib: float) -> Any:
    """Allocate and touch `gib` GiB on the current CUDA device; returns the tensor (keep it alive)."""
    if gib <= 0:
        return None
    import torch

    if not torch.cuda.is_available():
        _log(f"torch sees no CUDA device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
        raise SystemExit(1)
    t0 = time.monotonic()
    tensor = torch.empty(int(gib * _GIB), dtype=torch.uint8, device="cuda")
    tensor.fill_(1)  # touch it: the driver must really back it
    torch.cuda.synchronize()
    _log(f"allocated {gib:g} GiB on {torch.cuda.get_device_name()} in {time.monotonic() - t0:.1f} s")
    return tensor


def _ignore_sigterm_if_asked() -> bool:
    if os.environ.get("SPECTUNE_STANDIN_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, lambda _s, _f: _log("SIGTERM received and ignored (as asked)"))
        return True
    return False


def run_child() -> int:
    # stdout is the handshake pipe to the parent, which select()s on it: the child's log lines go
    # to stderr (the server log), or a log line buffered ahead of the handshake would hide it.
    handshake = sys.stdout
    sys.stdout = sys.stderr
    _ignore_sigterm_if_asked()
    parent = os.getppid()
    held = _allocate(_env_float("SPECTUNE_STANDIN_CHILD_GIB", 2.0))
    print("allocated", file=handshake, flush=True)  # noqa: T201 (the handshake line the parent waits for)
    deadline = time.monotonic() + _env_float("SPECTUNE_STANDIN_MAX_S", 3600.0)
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.5)
    del held
    _log("parent gone or lifetime over: exiting")
    return 0


def _spawn_child() -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-m", "scripts.gpu_standin", _CHILD_FLAG], stdout=subprocess.PIPE, text=True, close_fds=True
    )
    assert child.stdout is not None
    deadline = time.monotonic() + _CHILD_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            _log(f"child exited with {child.returncode} before allocating")
            raise SystemExit(1)
        ready, _, _ = select.select([child.stdout], [], [], 0.5)
        if ready and child.stdout.readline().strip() == "allocated":
            _log(f"child pid {child.pid} holds its memory")
            return child
    child.kill()
    _log(f"child did not allocate within {_CHILD_READY_TIMEOUT_S:.0f} s")
    raise SystemExit(1)


def _handler(info: dict[str, Any]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path in ("/health", "/health_generate", "/ready"):
                self._send(200, b"ok", "text/plain")
            elif path in ("/server_info", "/get_server_info"):
                self._send(200, json.dumps(info).encode(), "application/json")
            else:
                self._send(404, b"not found", "text/plain")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # keep the log for what matters

    return Handler


def run_server(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="GPU-holding SGLang stand-in", allow_abbrev=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--max-running-requests", type=int, default=None)
    args, ignored = parser.parse_known_args(argv)
    ignoring = _ignore_sigterm_if_asked()
    _log(f"pgid {os.getpgrp()}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}, ignoring {ignored}")
    gib = _env_float("SPECTUNE_STANDIN_GIB", 4.0)
    held = _allocate(gib)
    child = _spawn_child()
    info = {
        "version": "gpu-standin",
        "pid": os.getpid(),
        "child_pid": child.pid,
        "allocated_gib": gib,
        "attention_backend": args.attention_backend,
        "page_size": args.page_size,
        "max_running_requests": args.max_running_requests,
        "launch_command": " ".join([sys.executable, "-m", "scripts.gpu_standin", *argv]),
    }
    server = ThreadingHTTPServer((args.host, args.port), _handler(info))
    if not ignoring:
        # shutdown() blocks until serve_forever returns, so it must run off the main thread.
        signal.signal(signal.SIGTERM, lambda _s, _f: threading.Thread(target=server.shutdown, daemon=True).start())
    lifetime = threading.Timer(_env_float("SPECTUNE_STANDIN_MAX_S", 3600.0), server.shutdown)
    lifetime.daemon = True
    lifetime.start()
    _log(f"The server is fired up and ready to roll! (http://{args.host}:{args.port})")
    server.serve_forever(poll_interval=0.2)
    server.server_close()
    _log("shutting down")
    child.terminate()
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(timeout=10)
    del held
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == [_CHILD_FLAG]:
        return run_child()
    return run_server(args)


if __name__ == "__main__":
    raise SystemExit(main())
