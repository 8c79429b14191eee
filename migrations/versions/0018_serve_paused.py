"""serve paused: when `fleet destroy --all` (or `fleet serve --pause`) paused the [[serve]] targets, so that no
daemon rents their hosts again until `fleet serve --resume`

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-05 06:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("install") as batch:
        batch.add_column(sa.Column("serve_paused_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("install") as batch:
        batch.drop_column("serve_paused_at")
