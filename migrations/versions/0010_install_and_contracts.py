"""install id, contract ends, link speed: vast.ai round two

Every database is one install of fleet: its id goes into the label of every instance it rents, so that
reconcile takes only its own strays on an account another install shares. A host records when its
contract ends (vast.ai stops the instance then) and the link speed its offer advertised (the pull's
deadline scales with it).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 02:00:00
"""

import secrets

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    install = op.create_table(
        "install",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("install_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.bulk_insert(install, [{"id": 1, "install_id": secrets.token_hex(4)}])
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("contract_end_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))
        batch.add_column(sa.Column("inet_down_mbps", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("inet_down_mbps")
        batch.drop_column("contract_end_at")
    op.drop_table("install")
