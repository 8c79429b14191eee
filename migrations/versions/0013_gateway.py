"""the gateway: each open host's server slot in its target's backend, and the agents' keys (hashed)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02 08:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("gateway_slot", sa.Integer(), nullable=True))
    # one open host per slot of a target: two gateways (or processes) assigning at once cannot both win
    op.create_index(
        "ux_hosts_gateway_slot",
        "hosts",
        ["model", "region", "gateway_slot"],
        unique=True,
        sqlite_where=sa.text("destroyed_at IS NULL AND gateway_slot IS NOT NULL"),
        postgresql_where=sa.text("destroyed_at IS NULL AND gateway_slot IS NOT NULL"),
    )
    op.create_table(
        "agent_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("sha256", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("revoked_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("sha256"),
    )
    op.create_index("ix_agent_keys_name", "agent_keys", ["name"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_agent_keys_name", table_name="agent_keys")
    op.drop_table("agent_keys")
    op.drop_index("ux_hosts_gateway_slot", table_name="hosts")
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("gateway_slot")
