"""standby: what a stopped host's disk costs and how long it has been stopped

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 19:40:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("storage_usd_per_hour", sa.Float(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("stopped_hours", sa.Float(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("stopped_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("stopped_at")
        batch.drop_column("stopped_hours")
        batch.drop_column("storage_usd_per_hour")
