"""events: an index on (run_id, kind, ts)

The evaluators read a run's events of one kind every pass (the newest ``collectives`` ring,
the ``hang_verdict``, ``epoch_end`` and ``epoch_coverage``, a rollback's ``checkpoint``
events, ``attempt_start``). Through ``ix_events_run_id_ts`` each such read walked every
event of the run and kept those of its kind: a long run's thousands of ``rank_state`` and
``checkpoint`` events, read again every second. This index finds them by kind.

Revision ID: 0030
Revises: 0029
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(op.f("ix_events_run_id_kind_ts"), "events", ["run_id", "kind", "ts"])


def downgrade() -> None:
    op.drop_index(op.f("ix_events_run_id_kind_ts"), table_name="events")
