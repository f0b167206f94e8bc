"""The study document's cost reads every launch that ended, even one that ended while the
document was being read (api/services/studies.py `study_cost`).

Seen in the full suite at stop 45: `GET /v1/studies/{name}` answered 500 while a confirmation
completed.  `_records` had loaded the confirmation's lease row while it ran; the cost query, a
statement later, matched the row as completed, but the session handed back the instance it held,
with no `finished_at`, and `study_cost` failed its own assertion.
"""

from __future__ import annotations

import pytest

from api.db import make_engine, make_sessionmaker
from api.models import LeaseRow
from api.services.studies import study_cost
from tests.support.api_client import Api
from tests.support.helpers import ok_result
from tests.support.specs import INVENTORY, small_spec


@pytest.fixture
def db_url(pg_db_url: str) -> str:
    """Postgres only: there a statement sees what other transactions committed since the last
    one (read committed).  A SQLite reader's transaction keeps writers out until it ends."""
    return pg_db_url


def test_a_launch_that_ends_while_the_document_is_read_is_counted_not_a_server_error(api: Api) -> None:
    assert api.post("/v1/studies", "user", small_spec("cost-race")).status_code == 201
    lease = api.post("/v1/workers/gpu-a/lease", "fleet", INVENTORY).json()
    engine = make_engine(api.db_url or "")
    try:
        with make_sessionmaker(engine)() as s:
            # The document's reader holds the lease as it runs ...
            held = s.get(LeaseRow, lease["lease_id"])
            assert held is not None and held.finished_at is None
            assert study_cost(s, "cost-race").as_json()["launches"] == 0
            # ... the worker reports in another transaction ...
            done = api.post(f"/v1/leases/{lease['lease_id']}/complete", "fleet", ok_result(5992.0))
            assert done.status_code == 200, done.text
            # ... and the reader's next statement sees the launch that ended.
            assert study_cost(s, "cost-race").as_json()["launches"] == 1
    finally:
        engine.dispose()
