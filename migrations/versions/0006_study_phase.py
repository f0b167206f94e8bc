"""a study's phase, when its confirmation began, and why its search ended, as columns

The conductor (optimizer/conductor/) keeps a running study's phase (`search` |
`confirmation`) explicitly instead of inferring "confirming" from whether confirm leases exist,
and its finish reason as a value of optimizer/study_state.py's FinishReason next to the words.
Existing studies: one with confirm leases is in confirmation since its first one was queued; the
"; confirming ..." suffix older versions appended to finish_reason is dropped (the phase says it),
and the rule is read once from the words older versions began their reasons with.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 11:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

PHASES = ("search", "confirmation")
FINISH_RULES = (
    "max_trials", "max_hours", "space_exhausted", "converged", "does_not_pay", "patience", "stopped_by_user",
    "study_fault",
)  # fmt: skip
SUFFIX = "; confirming the best candidates against fresh baselines"
# How older versions' finish_reason began, per rule (only to fill finish_rule of stored studies).
PREFIXES = (
    ("max_trials=", "max_trials"),
    ("max_hours=", "max_hours"),
    ("every valid configuration", "space_exhausted"),
    ("converged after", "converged"),
    ("speculation does not pay", "does_not_pay"),
    ("patience=", "patience"),
    ("stopped by a user", "stopped_by_user"),
    ("stopped: its baseline failed", "study_fault"),
)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    with op.batch_alter_table("spectune_studies") as b:
        b.add_column(sa.Column("phase", sa.String(length=16), nullable=False, server_default="search"))
        b.add_column(sa.Column("confirmation_began_at", sa.DateTime(), nullable=True))
        b.add_column(sa.Column("finish_rule", sa.String(length=32), nullable=True))
        b.create_check_constraint("ck_study_phase", _in("phase", PHASES))
        b.create_check_constraint("ck_study_finish_rule", _in("finish_rule", FINISH_RULES))
    studies = sa.table(
        "spectune_studies",
        sa.column("name", sa.String),
        sa.column("state", sa.String),
        sa.column("phase", sa.String),
        sa.column("confirmation_began_at", sa.DateTime),
        sa.column("finish_reason", sa.String),
        sa.column("finish_rule", sa.String),
    )
    leases = sa.table(
        "spectune_leases",
        sa.column("study_name", sa.String),
        sa.column("kind", sa.String),
        sa.column("created_at", sa.DateTime),
    )
    conn = op.get_bind()
    began = dict(
        conn.execute(
            sa.select(leases.c.study_name, sa.func.min(leases.c.created_at))
            .where(leases.c.kind == "confirm")
            .group_by(leases.c.study_name)
        ).all()
    )
    for name, state, reason in conn.execute(sa.select(studies.c.name, studies.c.state, studies.c.finish_reason)).all():
        values: dict[str, object] = {}
        if name in began:
            values["confirmation_began_at"] = began[name]
            if state == "running":
                values["phase"] = "confirmation"
        if reason and SUFFIX in reason:
            values["finish_reason"] = reason.replace(SUFFIX, "")
        rule = next((r for p, r in PREFIXES if (reason or "").startswith(p)), None)
        if rule is not None:
            values["finish_rule"] = rule
        if values:
            conn.execute(sa.update(studies).where(studies.c.name == name).values(**values))


def downgrade() -> None:
    with op.batch_alter_table("spectune_studies") as b:
        b.drop_constraint("ck_study_finish_rule", type_="check")
        b.drop_constraint("ck_study_phase", type_="check")
        b.drop_column("finish_rule")
        b.drop_column("confirmation_began_at")
        b.drop_column("phase")
