"""sample_digests.epoch / kept, source_tokens: epoch coverage and the data mixture

With ``tw.init(dataset_size=N)`` (or ``tw.watch_loader``) each rank also sends, on a step
where it gave its sample ids, the step's epoch and the ids themselves (all of them while
the dataset holds at most 1,048,576 samples; beyond, the ids of a fixed sample of the
dataset): the health evaluator counts each epoch's distinct, repeated and missing ids
(collector/health/coverage.py). ``s.data_source(name, tokens)``: the tokens a step drew
from each source of a declared mixture (collector/health/mixture.py).

Revision ID: 0028
Revises: 0027
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sample_digests") as batch:
        batch.add_column(sa.Column("epoch", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("kept", sa.LargeBinary(), nullable=True))
    op.create_index(op.f("ix_sample_digests_run_id_epoch"), "sample_digests", ["run_id", "epoch"])
    bind = op.get_bind()
    if (
        bind.dialect.name == "postgresql"
        and bind.execute(
            sa.text(
                "SELECT 'lz4' = ANY(enumvals) FROM pg_settings "
                "WHERE name = 'default_toast_compression'"
            )
        ).scalar()
    ):
        # A step's ids (4 KiB for 512) are compressed as they are stored: pglz, the
        # default, costs PostgreSQL several times the CPU of lz4 a row
        # (bench/results/samples-ingest-cpu-2vcpu.txt).
        op.execute("ALTER TABLE sample_digests ALTER COLUMN kept SET COMPRESSION lz4")
    op.create_table(
        "source_tokens",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_source_tokens_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "step", "rank", "source", name=op.f("pk_source_tokens")),
    )


def downgrade() -> None:
    op.drop_table("source_tokens")
    op.drop_index(op.f("ix_sample_digests_run_id_epoch"), table_name="sample_digests")
    with op.batch_alter_table("sample_digests") as batch:
        batch.drop_column("kept")
        batch.drop_column("epoch")
