"""A restart that resumed from a suspect checkpoint.

A rollback restores the live processes; the checkpoints the trainer saved between the
anomaly and the rollback stay on disk until it saves over them. A job that restarts in
that window (a crash, an eviction, a preemption: torchrun, Slurm, Ray) resumes from its
newest checkpoint by step number (Hugging Face's ``checkpoint-N``, DeepSpeed's
``latest``, Lightning's ``last.ckpt``), which is one of those: the undone stretch comes
back, quietly. So does a restart while the anomaly is still active.

Each actions pass looks at the run's new attempts (a restart: attempt 2 on): once its
processes ran their first step ``f``, the checkpoint it resumed from is the newest one
the trainer reported for step ``f - 1`` before the attempt began. If that checkpoint is
suspect (:func:`..rollback.checkpoints`), a ``resumed_suspect_checkpoint`` event goes on
the run, once per attempt; the ``ResumedFromSuspectCheckpoint`` rule pages on it and,
as its action, rolls back to the newest good checkpoint.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, func, select

from trainwarden.collector.actions.rollback import checkpoints
from trainwarden.collector.store import models as m

KIND = "resumed_suspect_checkpoint"
WATCH_S = 3600.0
"""A restart is looked at for this long after it began (its first step may be late: a
large model's load)."""


def suspect_resumes(
    conn: Connection, *, now: float, margin_steps: int, checked: set[int]
) -> list[dict[str, Any]]:
    """The ``resumed_suspect_checkpoint`` events of restarts not looked at yet
    (``checked``: attempt ids decided, changed in place)."""
    a, s, e = m.attempts.c, m.attempt_sessions.c, m.events.c
    rows = conn.execute(
        select(a.id, a.run_id, a.number, a.started_at, func.min(s.first_step).label("first"))
        .join(m.attempt_sessions, (s.run_id == a.run_id) & (s.attempt == a.number))
        .where(a.number > 1, a.started_at >= now - WATCH_S, s.first_step.is_not(None))
        .group_by(a.id, a.run_id, a.number, a.started_at)
    ).all()
    out = []
    for row in rows:
        if row.id in checked:
            continue
        checked.add(row.id)
        resumed = int(row.first) - 1
        if resumed < 0:
            continue  # started from scratch: nothing resumed
        uid = f"{KIND}:{row.run_id}:{row.number}"
        if conn.execute(select(e.id).where(e.uid == uid)).first() is not None:
            continue  # said before this collector started
        before = [
            c
            for c in checkpoints(conn, row.run_id, margin_steps=margin_steps)
            if c["ts"] < row.started_at
        ]
        saved = [c for c in before if c["step"] == resumed]
        if not saved or saved[-1]["good"]:
            continue  # not reported (nothing to say), or good
        used = saved[-1]
        good = [c for c in before if c["good"] and c["step"] < resumed]
        newest_good = max(good, key=lambda c: (c["step"], c["ts"])) if good else None
        where = f" ({used['path']})" if used.get("path") else ""
        instead = (
            f"; the newest good one is of step {newest_good['step']}"
            if newest_good
            else "; no good checkpoint is on record"
        )
        out.append(
            {
                "run_id": row.run_id,
                "uid": uid,
                "kind": KIND,
                "rank": None,
                "step": resumed + 1,
                "severity": "critical",
                "data": {
                    "attempt": row.number,
                    "checkpoint_step": resumed,
                    "path": used.get("path"),
                    "suspect": used["suspect"],
                    "good_step": newest_good["step"] if newest_good else None,
                    "good_path": newest_good.get("path") if newest_good else None,
                    "reason": (
                        f"attempt {row.number} resumed at step {resumed + 1} from the "
                        f"checkpoint of step {resumed}{where}, which is suspect: "
                        f"{used['suspect']}{instead}"
                    ),
                },
            }
        )
    return out
