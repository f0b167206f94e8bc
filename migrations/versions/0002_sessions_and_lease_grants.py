"""dashboard sessions and lease grants

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 14:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'spectune_dashboard_sessions',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('sid_hash', sa.String(length=64), nullable=False),
        sa.Column('token_id', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.DateTime(), nullable=False),
        sa.Column('expires_at', sa.DateTime(), nullable=False),
        sa.Column('ended_at', sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('sid_hash'),
    )
    with op.batch_alter_table('spectune_dashboard_sessions', schema=None) as batch_op:
        batch_op.create_index('ix_spectune_dashboard_sessions_token_id', ['token_id'], unique=False)
    op.create_table(
        'spectune_lease_grants',
        sa.Column('lease_id', sa.String(length=36), nullable=False),
        sa.Column('token_id', sa.Integer(), nullable=False),
        sa.Column('granted_at', sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint('lease_id'),
    )


def downgrade() -> None:
    op.drop_table('spectune_lease_grants')
    with op.batch_alter_table('spectune_dashboard_sessions', schema=None) as batch_op:
        batch_op.drop_index('ix_spectune_dashboard_sessions_token_id')
    op.drop_table('spectune_dashboard_sessions')
