"""replica_checks.probe*, replica_results.probe_suspects / probes: the determinism probe

On a probed step each replica also sends the fingerprint and three sums of the model's
output on a fixed input (agent/probe.py) and the tolerance they are compared within; the
health evaluator compares them within each replica group beside the parameters'
fingerprints and keeps the probe's suspects with the step's comparison.

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("replica_checks") as batch:
        batch.add_column(sa.Column("probe", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("probe_sums", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("probe_rtol", sa.Float(), nullable=True))
    with op.batch_alter_table("replica_results") as batch:
        batch.add_column(sa.Column("probe_suspects", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("probes", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("replica_results") as batch:
        batch.drop_column("probes")
        batch.drop_column("probe_suspects")
    with op.batch_alter_table("replica_checks") as batch:
        batch.drop_column("probe_rtol")
        batch.drop_column("probe_sums")
        batch.drop_column("probe")
