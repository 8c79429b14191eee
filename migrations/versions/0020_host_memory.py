"""host memory: what the health sweep read of each host's RAM (the machine's total and available, the
server's resident set), so that a prompt cache or a leak that grows is seen before the kernel kills the server

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-05 09:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

COLUMNS = ("ram_total_mib", "ram_available_mib", "server_rss_mib")


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        for name in COLUMNS:
            batch.drop_column(name)
