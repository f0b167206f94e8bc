"""state and kind columns hold only the state machine's values (CHECK constraints)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 13:45:00

The values are api/services/leasing/states.py's enums; a row that escapes them (a typo, a
hand-edited row) is refused by the database.  SQLite cannot add a constraint to a table, so there
the table is rebuilt (Alembic's batch mode), and the partial unique index on active leases is
dropped and created again explicitly so its WHERE clause survives the rebuild.
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

LEASE_STATES = ("queued", "active", "completed", "failed", "expired", "superseded")
LEASE_KINDS = ("baseline", "trial", "confirm")
STUDY_STATES = ("running", "stopped", "finished")
CONFIG_STATES = ("pending", "done", "infeasible", "pruned", "failed")
ACTIVE = sa.text("state = 'active'")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    with op.batch_alter_table("spectune_leases") as b:
        b.drop_index("uq_lease_active_worker", postgresql_where=ACTIVE, sqlite_where=ACTIVE)
        b.create_check_constraint("ck_lease_state", _in("state", LEASE_STATES))
        b.create_check_constraint("ck_lease_kind", _in("kind", LEASE_KINDS))
    op.create_index(
        "uq_lease_active_worker", "spectune_leases", ["worker_id"], unique=True,
        postgresql_where=ACTIVE, sqlite_where=ACTIVE,
    )  # fmt: skip
    with op.batch_alter_table("spectune_studies") as b:
        b.create_check_constraint("ck_study_state", _in("state", STUDY_STATES))
    with op.batch_alter_table("spectune_trial_configs") as b:
        b.create_check_constraint("ck_config_state", _in("state", CONFIG_STATES))


def downgrade() -> None:
    with op.batch_alter_table("spectune_trial_configs") as b:
        b.drop_constraint("ck_config_state", type_="check")
    with op.batch_alter_table("spectune_studies") as b:
        b.drop_constraint("ck_study_state", type_="check")
    op.drop_index("uq_lease_active_worker", "spectune_leases", postgresql_where=ACTIVE, sqlite_where=ACTIVE)
    with op.batch_alter_table("spectune_leases") as b:
        b.drop_constraint("ck_lease_kind", type_="check")
        b.drop_constraint("ck_lease_state", type_="check")
    op.create_index(
        "uq_lease_active_worker", "spectune_leases", ["worker_id"], unique=True,
        postgresql_where=ACTIVE, sqlite_where=ACTIVE,
    )  # fmt: skip
