"""market pace: one budget of marketplace requests per endpoint for every process of an install (vast.ai limits
an identity, its key and the address it calls from, not a process)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05 04:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "market_pace",
        sa.Column("key", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("next_at", sa.Float(), nullable=False),
        sa.Column("recent", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.PrimaryKeyConstraint("key"),
    )


def downgrade() -> None:
    op.drop_table("market_pace")
