"""worker identities: a worker id is bound to one worker token on first use

Before this revision an unbound worker token could lease as any worker id (issue 18).  Ids in use
are bound here to the token their most recent granted lease was handed to, when that token is a
live, unbound worker token; the others are bound on their next use.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 11:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'spectune_worker_identities',
        sa.Column('worker_id', sa.String(length=128), nullable=False),
        sa.Column('token_id', sa.Integer(), nullable=False),
        sa.Column('bound_at', sa.DateTime(), nullable=False),
        sa.Column('moved_at', sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint('worker_id'),
    )
    with op.batch_alter_table('spectune_worker_identities', schema=None) as batch_op:
        batch_op.create_index('ix_worker_identity_token', ['token_id'], unique=False)
    _bind_ids_in_use()


def _bind_ids_in_use() -> None:
    leases = sa.table(
        'spectune_leases',
        sa.column('id', sa.String),
        sa.column('worker_id', sa.String),
        sa.column('leased_at', sa.DateTime),
    )
    grants = sa.table('spectune_lease_grants', sa.column('lease_id', sa.String), sa.column('token_id', sa.Integer))
    tokens = sa.table(
        'spectune_api_tokens',
        sa.column('id', sa.Integer),
        sa.column('role', sa.String),
        sa.column('worker_id', sa.String),
        sa.column('revoked_at', sa.DateTime),
    )
    identities = sa.table(
        'spectune_worker_identities',
        sa.column('worker_id', sa.String),
        sa.column('token_id', sa.Integer),
        sa.column('bound_at', sa.DateTime),
    )
    conn = op.get_bind()
    live_unbound = set(
        conn.execute(
            sa.select(tokens.c.id).where(
                tokens.c.role == 'worker', tokens.c.worker_id.is_(None), tokens.c.revoked_at.is_(None)
            )
        ).scalars()
    )
    latest: dict[str, int] = {}
    rows = conn.execute(
        sa.select(leases.c.worker_id, grants.c.token_id)
        .select_from(leases.join(grants, grants.c.lease_id == leases.c.id))
        .where(leases.c.worker_id.is_not(None))
        .order_by(leases.c.leased_at)
    ).all()
    for worker_id, token_id in rows:
        latest[worker_id] = token_id  # the last one wins
    now = sa.func.current_timestamp()
    for worker_id, token_id in sorted(latest.items()):
        if token_id in live_unbound:
            conn.execute(identities.insert().values(worker_id=worker_id, token_id=token_id, bound_at=now))


def downgrade() -> None:
    with op.batch_alter_table('spectune_worker_identities', schema=None) as batch_op:
        batch_op.drop_index('ix_worker_identity_token')
    op.drop_table('spectune_worker_identities')
