"""derived API keys, certificate ends: the hosts' llama-server keys are no longer kept in the database

A host's key is derived from a secret beside fleet's SSH key and a nonce made at each start
(fleet/core/apikeys.py); the database keeps the nonce. Closed hosts' keys in clear are erased; a live
host started before keeps its key in clear until it is replaced (nothing could derive it). A host records
when the certificate fleet signed for it ends: it is replaced before then.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 05:00:00
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

CLOSED = ("destroyed", "failed")


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("api_key_nonce", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        batch.add_column(sa.Column("certificate_until", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))
    hosts = sa.table("hosts", sa.column("state", sa.String()), sa.column("api_key", sa.String()))
    op.execute(hosts.update().where(hosts.c.state.in_(CLOSED)).values(api_key=None))


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("certificate_until")
        batch.drop_column("api_key_nonce")
