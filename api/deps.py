"""FastAPI dependencies: the service context, the caller's identity, and the services."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from api.auth import Principal, authenticate, require_role
from api.context import ServiceContext
from api.services.fleet import FleetService
from api.services.leasing.service import LeaseService
from api.services.studies import StudyService


def get_context(request: Request) -> ServiceContext:
    ctx: ServiceContext = request.app.state.ctx
    return ctx


ContextDep = Annotated[ServiceContext, Depends(get_context)]


def get_principal(ctx: ContextDep, authorization: Annotated[str | None, Header()] = None) -> Principal:
    with ctx.sessions() as s:
        return authenticate(s, authorization)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def get_user(principal: PrincipalDep) -> Principal:
    return require_role(principal, "user", "admin")


UserDep = Annotated[Principal, Depends(get_user)]


def get_studies(ctx: ContextDep) -> StudyService:
    return StudyService(ctx)


def get_leases(ctx: ContextDep) -> LeaseService:
    return LeaseService(ctx)


def get_fleet(ctx: ContextDep) -> FleetService:
    return FleetService(ctx)


StudiesDep = Annotated[StudyService, Depends(get_studies)]
LeasesDep = Annotated[LeaseService, Depends(get_leases)]
FleetDep = Annotated[FleetService, Depends(get_fleet)]
