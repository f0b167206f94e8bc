"""What the fleet decided about this worker, said in its own log (issue 33 item 6).

The API sends the worker's standing with every lease answer (spectune_protocol.WorkerStanding):
whether it is quarantined, and which studies it is no longer offered because it refused them.
Without it a quarantined host just hears "no work" forever, and its operator has to find
`spectune workers list` to learn why.  Each change is logged once, with the reason and the command
that clears it; nothing here acts on it (the API decides what to offer).
"""

from __future__ import annotations

import logging

from spectune_protocol import WorkerStanding


def changes(was: WorkerStanding, now: WorkerStanding, worker_id: str) -> list[tuple[int, str]]:
    """The log lines (level, text) for what changed from `was` to `now`."""
    out: list[tuple[int, str]] = []
    if now.quarantined is not None and was.quarantined is None:
        out.append(
            (
                logging.ERROR,
                f"this worker is QUARANTINED by the fleet and gets no work: {now.quarantined}; fix the host, "
                f"then an admin clears it with `spectune workers release {worker_id}`",
            )
        )
    elif now.quarantined is None and was.quarantined is not None:
        out.append((logging.WARNING, "this worker was RELEASED from quarantine: it takes work again"))
    before = {r.study for r in was.refused}
    for r in now.refused:
        if r.study not in before:
            out.append(
                (
                    logging.WARNING,
                    f"study {r.study} is no longer offered to this worker: it REFUSED it ({r.reason}); "
                    f"`spectune workers clear-refusals {worker_id}` offers it again, as does a restart with a "
                    "changed allowlist, model registry or prompt folder",
                )
            )
    after = {r.study for r in now.refused}
    for study in sorted(before - after):
        out.append((logging.INFO, f"study {study} is offered to this worker again (its refusal ended)"))
    return out
