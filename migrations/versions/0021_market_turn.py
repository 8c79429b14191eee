"""market turn: a marketplace call in flight holds its endpoint for every process of the install until its answer,
and the next call starts its interval after that answer (a busy machine's late send can no longer close the gap)

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-05 12:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("market_pace") as batch:
        batch.add_column(sa.Column("held_until", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("market_pace") as batch:
        batch.drop_column("held_until")
