"""pulled bytes: the size of a host's model files, for the pull rate a machine is remembered by

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 16:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("pulled_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("pulled_bytes")
