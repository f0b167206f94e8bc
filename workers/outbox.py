"""The on-disk outbox: no measurement is lost because the API was down when a lease finished.

A finished lease's report is written here atomically (temporary file, fsync, rename, fsync of the
folder) *before* it is sent, and removed only after the API acknowledged it.  A crash, a reboot or
an API outage therefore leaves the report on disk, and the agent delivers pending reports first on
every turn of its loop and at start-up.  Reports the API refuses for good (a 4xx other than lease
loss) move to `rejected/` for a human to look at; they are never retried blindly or deleted.

One file per lease, named after the lease id, so writing the same report twice is harmless (the
API's `complete` is idempotent too).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from spectune_protocol import CompleteIn
from workers.client import ApiClient, ApiError, ApiRejected, ApiUnavailable, AuthError, LeaseLost

log = logging.getLogger("spectune.worker.outbox")

_SAFE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}\Z")
_SUFFIX = ".json"


@dataclass(frozen=True)
class PendingReport:
    lease_id: str
    report: CompleteIn
    path: Path
    queued_at: str


def _file_name(lease_id: str) -> str:
    if _SAFE_ID_RE.match(lease_id):
        return lease_id + _SUFFIX
    # An id with odd characters still gets a stable, harmless name; the id itself is in the file.
    return "lease-" + hashlib.sha256(lease_id.encode()).hexdigest()[:32] + _SUFFIX


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Outbox:
    """Reports waiting for the API's acknowledgement, one JSON file per lease under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.rejected_dir = root / "rejected"
        self.rejected_dir.mkdir(parents=True, exist_ok=True)
        self._clean_temporaries()

    def _clean_temporaries(self) -> None:
        # A crash between write and rename leaves a temporary file; its report was never
        # acknowledged as queued, and the lease will be reclaimed by the API, so it can go.
        for tmp in self.root.glob(".*.tmp"):
            log.warning("removing a half-written outbox file from an earlier crash: %s", tmp.name)
            tmp.unlink(missing_ok=True)

    def put(self, lease_id: str, report: CompleteIn) -> Path:
        """Store a report durably (atomic replace) and return its path."""
        path = self.root / _file_name(lease_id)
        payload = {
            "lease_id": lease_id,
            "queued_at": datetime.now(UTC).isoformat(),
            "report": report.model_dump(mode="json"),
        }
        data = json.dumps(payload, indent=1, sort_keys=True).encode()
        tmp = self.root / f".{path.name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.root)
        return path

    def pending(self) -> list[PendingReport]:
        """Reports waiting for delivery, oldest first.  Unreadable files are moved to rejected/."""
        out = []
        for path in sorted(self.root.glob("*" + _SUFFIX), key=lambda p: (p.stat().st_mtime, p.name)):
            try:
                raw = json.loads(path.read_bytes())
                report = CompleteIn.model_validate(raw["report"])
                out.append(PendingReport(str(raw["lease_id"]), report, path, str(raw.get("queued_at", ""))))
            except (OSError, ValueError, KeyError, TypeError, ValidationError) as e:
                log.error("outbox file %s cannot be read (%s); moving it to %s", path.name, e, self.rejected_dir)
                self._move_to_rejected(path, f"unreadable: {e}")
        return out

    def remove(self, item: PendingReport) -> None:
        item.path.unlink(missing_ok=True)
        _fsync_dir(self.root)

    def reject(self, item: PendingReport, reason: str) -> Path:
        """Keep a report the API refused for good, with the reason, out of the delivery queue."""
        return self._move_to_rejected(item.path, reason)

    def _move_to_rejected(self, path: Path, reason: str) -> Path:
        target = self.rejected_dir / path.name
        os.replace(path, target)
        (self.rejected_dir / (path.name + ".reason.txt")).write_text(reason + "\n", encoding="utf-8")
        _fsync_dir(self.root)
        return target

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*" + _SUFFIX))


def deliver_pending(outbox: Outbox, client: ApiClient, *, retry_for_s: float | None = None) -> bool:
    """Send every pending report; True when the outbox is empty afterwards.

    Acknowledged reports are removed; reports for leases that are no longer ours (409/410) are
    dropped after logging, since the API has already settled that lease; reports the API refuses
    (other 4xx) move to rejected/.  Stops at the first ApiUnavailable (the API is down: the rest
    would fail the same way).  AuthError propagates: the worker cannot go on without a valid token.
    """
    for item in outbox.pending():
        try:
            answer = client.complete(item.lease_id, item.report, retry_for_s=retry_for_s)
        except ApiUnavailable as e:
            log.warning("report for lease %s stays in the outbox: %s", item.lease_id, e)
            return False
        except LeaseLost as e:
            log.warning(
                "dropping the %s report for lease %s, queued %s: %s",
                item.report.outcome,
                item.lease_id,
                item.queued_at,
                e,
            )
            outbox.remove(item)
        except ApiRejected as e:
            target = outbox.reject(item, str(e))
            log.error("the API REJECTED the report for lease %s (%s); kept in %s", item.lease_id, e, target)
        except AuthError:
            raise
        except ApiError as e:  # a protocol mismatch: keep it for a fixed API, as for a rejection
            target = outbox.reject(item, str(e))
            log.error("report for lease %s could not be delivered (%s); kept in %s", item.lease_id, e, target)
        else:
            outbox.remove(item)
            log.info(
                "report for lease %s delivered: state %s%s%s",
                item.lease_id,
                answer.state,
                "" if answer.speedup is None else f", speedup {answer.speedup:.3f}",
                " (already recorded)" if answer.duplicate else "",
            )
    return True
