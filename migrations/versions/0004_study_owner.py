"""studies remember the token that created them (per-user limit on running studies)

Studies created before this revision have no owner and count against nobody's limit.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 10:45:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('spectune_studies', schema=None) as batch_op:
        batch_op.add_column(sa.Column('created_by', sa.Integer(), nullable=True))
        batch_op.create_index('ix_spectune_studies_created_by_state', ['created_by', 'state'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('spectune_studies', schema=None) as batch_op:
        batch_op.drop_index('ix_spectune_studies_created_by_state')
        batch_op.drop_column('created_by')
