"""image pulls: each host's image size, which its machine downloads at create (billed, and waited for)

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05 05:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("image_bytes", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("image_bytes")
