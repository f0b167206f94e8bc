"""which worker token took and reported each lease

A confirmation counts as independent only when another token than the one that found its
candidate measured it, next to a baseline of its own token (issue 35), and a study stops for its
own fault only when two tokens agree: both need to know which token reported each lease.  Leases
reported before this revision have none (NULL): they are judged by their worker id alone.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 05:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("spectune_leases") as batch:
        batch.add_column(sa.Column("token_id", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("spectune_leases") as batch:
        batch.drop_column("token_id")
