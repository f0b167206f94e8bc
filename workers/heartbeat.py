"""Lease heartbeats from a background thread, while the main thread launches and benchmarks.

The thread loops on `stop_event.wait(interval)` (as Optuna's HeartbeatThread does), so stopping
it is immediate.  When the API answers 409/410 the lease is lost: the thread sets `lost` and the
lease's `cancel` event, which aborts the launch or the benchmark at once.  Any other failure is
logged and the next beat tries again; the API's deadline, not this thread, decides when a lease
is gone.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType

from workers.client import ApiClient, ApiError, AuthError, LeaseLost

log = logging.getLogger("spectune.worker.heartbeat")


class Heartbeat:
    """Beats for one lease until `stop()`; use as a context manager around the lease's work."""

    def __init__(self, client: ApiClient, lease_id: str, interval_s: float, *, cancel: threading.Event) -> None:
        if interval_s <= 0:
            raise ValueError(f"heartbeat interval must be positive, got {interval_s}")
        self.lease_id = lease_id
        self.interval_s = interval_s
        self.lost = threading.Event()
        self.beats = 0
        self._client = client
        self._cancel = cancel
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{lease_id}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop beating; waits for a beat in flight (bounded by the HTTP time-out) unless `timeout_s`."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                # Retry within one interval only: the next beat is the better retry.
                answer = self._client.heartbeat(self.lease_id, retry_for_s=self.interval_s / 2)
            except LeaseLost as e:
                log.error("lease %s lost: %s; abandoning its work", self.lease_id, e)
                self.lost.set()
                self._cancel.set()
                return
            except AuthError as e:
                # Keep beating: the main loop meets the same error on its next call and exits.
                log.error("heartbeat for lease %s: %s", self.lease_id, e)
            except ApiError as e:
                log.warning("heartbeat for lease %s failed: %s", self.lease_id, e)
            except Exception:  # never let a bug kill the thread silently while the lease runs
                log.exception("heartbeat for lease %s: unexpected error", self.lease_id)
            else:
                self.beats += 1
                log.debug("heartbeat for lease %s: deadline %s", self.lease_id, answer.deadline.isoformat())
