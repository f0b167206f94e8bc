"""How often this host has started work on each lease: the worker's guard against relaunch loops.

A restart is 10–15 minutes of an 8-GPU node, so a loop that relaunches a server is the worst bug
this product can have.  The API should never hand a lease back once its work ended, but the worker
does not rely on that: every lease id it starts is counted here, on disk beside the outbox (so a
worker that crashes on every launch and is restarted by systemd is caught too), and a lease offered
more than `max_starts` times is refused and reported instead of launched.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("spectune.worker.ledger")

LEDGER_FILE = "lease-starts.ledger"
# Kept entries: far more than the leases one host runs between two looks at a loop.
MAX_ENTRIES = 512


class LaunchLedger:
    def __init__(self, folder: Path, *, max_starts: int = 2) -> None:
        self.path = folder / LEDGER_FILE
        self.max_starts = max_starts
        self._starts: OrderedDict[str, int] = OrderedDict()
        self._ended: set[str] = set()
        self._load()

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("ignoring an unreadable lease ledger %s: %s", self.path, e)
            return
        for lease_id, count in (raw.get("starts") or {}).items():
            if isinstance(lease_id, str) and isinstance(count, int):
                self._starts[lease_id] = count
        self._ended = {x for x in raw.get("ended") or [] if isinstance(x, str) and x in self._starts}

    def _save(self) -> None:
        while len(self._starts) > MAX_ENTRIES:
            old, _ = self._starts.popitem(last=False)
            self._ended.discard(old)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"starts": dict(self._starts), "ended": sorted(self._ended)}))
            os.replace(tmp, self.path)
        except OSError as e:  # a full disk must not stop the work; the in-memory guard still holds
            log.error("cannot write the lease ledger %s: %s", self.path, e)

    def refusal(self, lease_id: str) -> str | None:
        """Why this lease must not be started again, or None."""
        if lease_id in self._ended:
            return "this worker already ended its work on this lease (reported, lost or abandoned)"
        starts = self._starts.get(lease_id, 0)
        if starts >= self.max_starts:
            return f"this worker already started it {starts} times (at most {self.max_starts})"
        return None

    def started(self, lease_id: str) -> None:
        self._starts[lease_id] = self._starts.get(lease_id, 0) + 1
        self._starts.move_to_end(lease_id)
        self._save()

    def ended(self, lease_id: str) -> None:
        """Its work is over (reported or abandoned): it is never started again on this host."""
        self._starts.setdefault(lease_id, 0)
        self._ended.add(lease_id)
        self._save()
