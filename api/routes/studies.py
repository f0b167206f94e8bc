"""/v1/studies: create, list, show, stop, resume, trials."""

from __future__ import annotations

from fastapi import APIRouter, status

from api.deps import StudiesDep, UserDep
from api.documents import StudyBrief, StudyDocument, StudySummary, TrialRow
from optimizer.spec import StudySpec

router = APIRouter(prefix="/v1/studies", tags=["studies"])


@router.post("", status_code=status.HTTP_201_CREATED)
def create_study(spec: StudySpec, user: UserDep, studies: StudiesDep) -> StudyDocument:
    """Create a study from its spec (see README "The study spec").

    429 when the token already has `SPECTUNE_MAX_RUNNING_STUDIES_PER_USER` running studies.
    """
    return studies.create(spec, owner=user.token_id)


@router.get("")
def list_studies(_: UserDep, studies: StudiesDep) -> list[StudySummary]:
    return studies.list_studies()


@router.get("/{name}")
def show_study(name: str, _: UserDep, studies: StudiesDep) -> StudyDocument:
    """State, trial counts, the best configuration with its speedup and exact launch command."""
    return studies.show(name)


@router.post("/{name}/stop")
def stop_study(name: str, _: UserDep, studies: StudiesDep) -> StudyDocument | StudyBrief:
    """No new trials are handed out; leases in flight may still report."""
    return studies.stop(name)


@router.post("/{name}/resume")
def resume_study(name: str, _: UserDep, studies: StudiesDep) -> StudyDocument:
    """A stopped study hands out trials again, with the budget it has left."""
    return studies.resume(name)


@router.get("/{name}/trials")
def list_trials(name: str, _: UserDep, studies: StudiesDep) -> list[TrialRow]:
    return studies.trials(name)
