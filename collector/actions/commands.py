"""Commands waiting for agents (rollback phases, stops): which runs have any, and a
rank's own, taken on its ingest answer until acknowledged."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select, update

from trainwarden.collector.store import models as m


class CommandBoard:
    """Which runs have commands waiting, so that ingest looks for them only then."""

    def __init__(self) -> None:
        self.runs: set[str] = set()

    def refresh(self, conn: Connection) -> None:
        c = m.agent_commands.c
        self.runs = set(
            conn.execute(
                select(m.runs.c.name)
                .distinct()
                .join(m.agent_commands, c.run_id == m.runs.c.id)
                .where(c.done_at.is_(None))
            ).scalars()
        )

    def take(self, conn: Connection, run: str, rank: int, now: float) -> list[dict[str, Any]]:
        """The commands for ``rank`` of ``run`` not yet acknowledged (sent again until they are)."""
        if run not in self.runs:
            return []
        c = m.agent_commands.c
        rows = conn.execute(
            select(c.id, c.body, c.delivered_at)
            .join(m.runs, m.runs.c.id == c.run_id)
            .where(m.runs.c.name == run, c.rank == rank, c.done_at.is_(None))
            .order_by(c.id)
        ).all()
        fresh = [r.id for r in rows if r.delivered_at is None]
        if fresh:
            conn.execute(update(m.agent_commands).where(c.id.in_(fresh)).values(delivered_at=now))
        return [{"id": r.id, **r.body} for r in rows]
