"""Prometheus metrics for the API: `GET /metrics` (any valid token).

Two kinds, so that several API processes serving one database give consistent numbers:

* **from the database at scrape time** (the same in every process): leases issued and expired,
  leases by state, trials by study and state, failures by kind, studies by state, quarantined
  workers.  Counters are counts of append-only facts (lease rows that were handed out, and
  `lease_expired` events), so they only grow.
* **per process** (each process exposes its own; Prometheus scrapes every instance): request
  latency histograms labelled by route template, which cover lease (`/v1/workers/{worker_id}/lease`)
  and complete (`/v1/leases/{lease_id}/complete`) latency.

The registry belongs to the app (never the global one), so several apps in one test process do
not collide.  A scrape needs a `user` or `admin` token: the numbers reveal study names and fleet
size, which a network neighbour need not learn, and a worker token may only lease and report
(docs/design.md "Security").  Give Prometheus its own revocable token (`spectune token create --role
user --name prometheus`, read through `authorization: {credentials_file: ...}` in its scrape config).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterator

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from api.context import ServiceContext
from api.deps import UserDep
from api.models import EventRow, LeaseRow, StudyRow, WorkerRow
from api.optuna_tables import trial_counts

# Latencies from a few ms (heartbeat) to tens of seconds (a complete that waits for a lock).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DatabaseCollector(Collector):
    """Gauges and counters computed from spectune's and Optuna's tables on each scrape."""

    def __init__(self, ctx_of: Callable[[], ServiceContext | None]) -> None:
        self._ctx_of = ctx_of

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        ctx = self._ctx_of()
        if ctx is None:  # before the lifespan opened the context
            return
        issued = CounterMetricFamily("spectune_leases_issued", "Leases handed to a worker", labels=["kind"])
        expired = CounterMetricFamily("spectune_leases_expired", "Leases reclaimed after a missed deadline")
        leases = GaugeMetricFamily("spectune_leases", "Leases by kind and state", labels=["kind", "state"])
        failures = GaugeMetricFamily(
            "spectune_lease_failures", "Leases reported failed, by failure kind", labels=["study", "kind"]
        )
        studies = GaugeMetricFamily("spectune_studies", "Studies by state", labels=["state"])
        quarantined = GaugeMetricFamily("spectune_workers_quarantined", "Workers that get no more work")
        workers = GaugeMetricFamily("spectune_workers", "Workers ever seen")
        with ctx.sessions() as s:
            for kind, n in s.execute(
                select(LeaseRow.kind, func.count()).where(LeaseRow.leased_at.is_not(None)).group_by(LeaseRow.kind)
            ):
                issued.add_metric([kind], n)
            expired.add_metric([], s.scalar(select(func.count()).where(EventRow.kind == "lease_expired")) or 0)
            for kind, state, n in s.execute(
                select(LeaseRow.kind, LeaseRow.state, func.count()).group_by(LeaseRow.kind, LeaseRow.state)
            ):
                leases.add_metric([kind, state], n)
            kinds: Tally[tuple[str, str]] = Tally()
            for study, result in s.execute(
                select(LeaseRow.study_name, LeaseRow.result).where(LeaseRow.state == "failed")
            ):
                kind = ((result or {}).get("failure") or {}).get("kind") or "unknown"
                kinds[(study, kind)] += 1
            for (study, kind), n in sorted(kinds.items()):
                failures.add_metric([study, kind], n)
            for state, n in s.execute(select(StudyRow.state, func.count()).group_by(StudyRow.state)):
                studies.add_metric([state], n)
            quarantined.add_metric([], s.scalar(select(func.count()).where(WorkerRow.quarantined.is_(True))) or 0)
            workers.add_metric([], s.scalar(select(func.count()).select_from(WorkerRow)) or 0)
        yield from (issued, expired, leases, failures, studies, quarantined, workers)
        yield from self._eligibility(ctx)
        yield self._trials(ctx)

    @staticmethod
    def _eligibility(ctx: ServiceContext) -> Iterator[GaugeMetricFamily]:
        """Per running study: workers that can take it, and 1 per requirement no worker meets."""
        from api.services.studies import study_eligibility
        from optimizer.spec import StudySpec

        eligible = GaugeMetricFamily(
            "spectune_study_eligible_workers", "Workers that can take a running study now", labels=["study"]
        )
        stuck = GaugeMetricFamily(
            "spectune_study_no_eligible_worker",
            "1 while no registered worker can take a running study, by the requirement none meets",
            labels=["study", "requirement"],
        )
        # The study document's own computation (refusals included), so the two never disagree.
        with ctx.sessions() as s:
            for row in s.scalars(select(StudyRow).where(StudyRow.state == "running")):
                e = study_eligibility(s, StudySpec.model_validate(row.spec))
                eligible.add_metric([row.name], len(e.eligible_workers))
                for requirement in e.unmet:
                    stuck.add_metric([row.name, requirement], 1)
        yield from (eligible, stuck)

    @staticmethod
    def _trials(ctx: ServiceContext) -> GaugeMetricFamily:
        # Optuna's own tables, read with SQL (api.optuna_tables): loading every study through
        # Optuna on each scrape would cost a query per study.
        trials = GaugeMetricFamily("spectune_trials", "Optuna trials by study and state", labels=["study", "state"])
        for study, counts in trial_counts(ctx.rdb.engine).items():
            for state, n in counts.items():
                if n:
                    trials.add_metric([study, state], n)
        return trials


class ApiMetrics:
    """The app's registry: the database collector and the per-process latency histogram."""

    def __init__(self, ctx_of: Callable[[], ServiceContext | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DatabaseCollector(ctx_of))
        self.latency = Histogram(
            "spectune_http_request_duration_seconds",
            "API request latency by route template (this process)",
            labelnames=("method", "route", "status"),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

        self.unhandled = Counter(
            "spectune_http_unhandled_errors",
            "Requests answered 500 because an unexpected exception escaped (a bug; see the server log)",
            labelnames=("method", "route", "exception"),
            registry=self.registry,
        )

    def count_unhandled(self, request: Request, exc: Exception) -> None:
        template = getattr(request.scope.get("route"), "path", None) or "unmatched"
        self.unhandled.labels(request.method, template, type(exc).__name__).inc()

    def count_dashboard_error(self, method: str, status: int) -> None:
        """optuna-dashboard answered 5xx itself (its framework catches its own exceptions)."""
        self.unhandled.labels(method, "dashboard", f"dashboard_{status}").inc()

    def install(self, app: FastAPI) -> None:
        """Time every request; label it by the route template, never by the raw path."""

        @app.middleware("http")
        async def time_requests(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            start = time.perf_counter()
            response = await call_next(request)
            # Routes put themselves in the scope; the dashboard mount only its endpoint.
            template = getattr(request.scope.get("route"), "path", None)
            label = template or ("dashboard" if "endpoint" in request.scope else "unmatched")
            self.latency.labels(request.method, label, str(response.status_code)).observe(time.perf_counter() - start)
            return response

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metrics_router(metrics: ApiMetrics) -> APIRouter:
    router = APIRouter(tags=["metrics"])

    @router.get("/metrics", response_class=Response)
    def scrape(_: UserDep) -> Response:
        """Prometheus text format; a user or admin token."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
