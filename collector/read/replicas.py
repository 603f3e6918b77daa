"""Reading replica comparisons: each checked step's verdict per replica group."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select

from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.store import models as m


def results(conn: Connection, *, run: str, last: int = 200) -> list[dict[str, Any]]:
    """The newest ``last`` comparisons of ``run``, oldest first: step, replica group,
    whether the group agreed, its suspects and the members that sent no fingerprint; on a
    probed step, the determinism probe's suspects and how many probes were compared."""
    run_id = conn.execute(select(m.runs.c.id).where(m.runs.c.name == run)).scalar()
    if run_id is None:
        raise NotFound(f"run {run!r} not found")
    r = m.replica_results.c
    rows = conn.execute(
        select(m.replica_results)
        .where(r.run_id == run_id)
        .order_by(r.step.desc(), r.replica_group)
        .limit(last)
    ).all()
    return [
        {
            "step": row.step,
            "replica_group": row.replica_group,
            "agree": row.agree,
            "suspects": list(row.suspects or ()),
            "missing": list(row.missing or ()),
            "fingerprints": row.fingerprints,
            "probe_suspects": None if row.probes is None else list(row.probe_suspects or ()),
            "probes": row.probes,
            "decided_at": row.decided_at,
        }
        for row in reversed(rows)
    ]
