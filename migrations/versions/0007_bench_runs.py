"""bench runs: the capacity a host held at its profile's voice target, and the cost per voice-minute

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 16:40:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "bench_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("first_content_p95_ms_target", sa.Float(), nullable=False),
        sa.Column("decode_tok_s_target", sa.Float(), nullable=False),
        sa.Column("capacity", sa.Integer(), nullable=False),
        sa.Column("capacity_at_least", sa.Boolean(), nullable=False),
        sa.Column("usd_per_voice_minute", sa.Float(), nullable=True),
        sa.Column("levels", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.ForeignKeyConstraint(["host_id"], ["hosts.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("bench_runs") as batch:
        batch.create_index(batch.f("ix_bench_runs_at"), ["at"], unique=False)
        batch.create_index(batch.f("ix_bench_runs_host_id"), ["host_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("bench_runs") as batch:
        batch.drop_index(batch.f("ix_bench_runs_host_id"))
        batch.drop_index(batch.f("ix_bench_runs_at"))
    op.drop_table("bench_runs")
