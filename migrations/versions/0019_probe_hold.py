"""probe hold: a READY host held from new calls until this time, while a thermal re-probe waits for the calls it
carries to end (no probe's load ever runs beside a live call)

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-05 07:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("held_until", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("held_until")
