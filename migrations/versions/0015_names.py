"""names: the DNS name each host's certificate was signed for (its clients check it), and the fingerprint of
the CA this install's hosts trust (a machine without that CA's key refuses to make another)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05 03:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("tls_name", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
    with op.batch_alter_table("install") as batch:
        batch.add_column(sa.Column("ca_sha256", sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("install") as batch:
        batch.drop_column("ca_sha256")
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("tls_name")
