"""dashboard sessions and lease grants; stop studies whose spec fails today's checks

Specs are checked more strictly since this revision (finite numbers within usable ranges, at
most 64 concurrency levels, names without a trailing newline).  A study stored before with a spec
that fails the checks could never run (its leases answered 500); it is stopped here, with the
reason, and its queued or active leases are superseded, so nothing ever loads that spec again
to hand out or reclaim work.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 14:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
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


    _stop_studies_failing_the_checks()


def _stop_studies_failing_the_checks() -> None:
    from pydantic import ValidationError

    from optimizer.spec import StudySpec

    studies = sa.table(
        'spectune_studies',
        sa.column('name', sa.String),
        sa.column('state', sa.String),
        sa.column('spec', sa.JSON),
        sa.column('finished_at', sa.DateTime),
        sa.column('finish_reason', sa.String),
    )
    leases = sa.table(
        'spectune_leases',
        sa.column('study_name', sa.String),
        sa.column('state', sa.String),
        sa.column('finished_at', sa.DateTime),
    )
    conn = op.get_bind()
    now = sa.func.current_timestamp()
    for name, state, spec in conn.execute(sa.select(studies.c.name, studies.c.state, studies.c.spec)).all():
        try:
            StudySpec.model_validate(spec)
            continue
        except ValidationError as e:
            first = e.errors()[0]
            problem = f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
        if state == 'running':
            reason = f"stopped at upgrade: its spec fails this version's checks ({problem})"[:256]
            conn.execute(
                studies.update()
                .where(studies.c.name == name)
                .values(state='stopped', finished_at=now, finish_reason=reason)
            )
        conn.execute(
            leases.update()
            .where(leases.c.study_name == name, leases.c.state.in_(('queued', 'active')))
            .values(state='superseded', finished_at=now)
        )


def downgrade() -> None:
    op.drop_table('spectune_lease_grants')
    with op.batch_alter_table('spectune_dashboard_sessions', schema=None) as batch_op:
        batch_op.drop_index('ix_spectune_dashboard_sessions_token_id')
    op.drop_table('spectune_dashboard_sessions')
