"""no pickled jobs: the daemon's scheduler keeps its jobs in memory

APScheduler's SQLAlchemy job store unpickles what anyone with write access to the database puts in its
table. The daemon rebuilds its jobs at every start and claims each tick in job_runs, so it loses nothing
without it.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 03:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("apscheduler_jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_apscheduler_jobs_next_run_time"))
    op.drop_table("apscheduler_jobs")


def downgrade() -> None:
    op.create_table(
        "apscheduler_jobs",
        sa.Column("id", sa.Unicode(length=191), nullable=False),
        sa.Column("next_run_time", sa.Float(precision=25), nullable=True),
        sa.Column("job_state", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("apscheduler_jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_apscheduler_jobs_next_run_time"), ["next_run_time"], unique=False)
