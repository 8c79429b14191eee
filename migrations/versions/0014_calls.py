"""capacity in calls: a bench's conversation levels, the calls it held at the voice target, the calls its
speakers and duty predict, the duty and the gap between turns

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03 15:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("bench_runs") as batch:
        batch.add_column(sa.Column("calls_capacity", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("calls_at_least", sa.Boolean(), nullable=True))
        batch.add_column(sa.Column("calls_predicted", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("calls_duty", sa.Float(), nullable=True))
        batch.add_column(sa.Column("turn_gap_s", sa.Float(), nullable=True))
        batch.add_column(
            sa.Column("calls_levels", sqlmodel.sql.sqltypes.AutoString(), nullable=False, server_default="[]")
        )


def downgrade() -> None:
    with op.batch_alter_table("bench_runs") as batch:
        for name in ("calls_levels", "turn_gap_s", "calls_duty", "calls_predicted", "calls_at_least", "calls_capacity"):
            batch.drop_column(name)
