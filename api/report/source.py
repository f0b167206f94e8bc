"""Where a report's data comes from: the API (with a token) or the database directly.

Both give the same two documents, the study (`GET /v1/studies/{name}`) and its trials
(`GET /v1/studies/{name}/trials`), as their typed models (api/documents.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from pydantic import ValidationError

from api.documents import StudyDocument, TrialRow


class ReportSourceError(Exception):
    """The study could not be read; the message says why and how to fix it."""


@dataclass(frozen=True)
class StudyData:
    shown: StudyDocument
    trials: list[TrialRow]


def load_from_api(client: httpx.Client, name: str) -> StudyData:
    """Read through the API; `client` carries the base URL and the bearer token."""
    docs = []
    for path in (f"/v1/studies/{name}", f"/v1/studies/{name}/trials"):
        try:
            r = client.get(path)
        except httpx.HTTPError as e:
            raise ReportSourceError(f"cannot reach the API at {client.base_url}: {e}") from e
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:200]
            raise ReportSourceError(f"{r.status_code}: {message}")
        docs.append(r.json())
    try:
        return StudyData(
            shown=StudyDocument.model_validate(docs[0]), trials=[TrialRow.model_validate(t) for t in docs[1]]
        )
    except ValidationError as e:
        raise ReportSourceError(f"the API at {client.base_url} answered documents this version cannot read: {e}") from e


def load_from_database(database_url: str, name: str) -> StudyData:
    """Read the database directly (no API needed), through the same service code the API runs."""
    from api.context import ServiceContext
    from api.services.studies import StudyService
    from api.settings import Settings
    from optimizer.errors import StudyNotFoundError

    ctx = ServiceContext.open(Settings(database_url=database_url))
    try:
        service = StudyService(ctx)
        return StudyData(shown=service.show(name), trials=service.trials(name))
    except StudyNotFoundError as e:
        raise ReportSourceError(f"no study named {name!r} in this database") from e
    finally:
        ctx.close()
