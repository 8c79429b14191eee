"""host ownership: an owner and a lease on every host being worked on; when its create left

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 13:40:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("owner", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        batch.add_column(sa.Column("lease_until", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))
        batch.add_column(sa.Column("create_sent_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))
        batch.create_index(batch.f("ix_hosts_owner"), ["owner"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.drop_index(batch.f("ix_hosts_owner"))
        batch.drop_column("create_sent_at")
        batch.drop_column("lease_until")
        batch.drop_column("owner")
