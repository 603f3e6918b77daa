"""A stopped run stays stopped when its launcher restarts it.

A stop ends every rank with status 76 (``tw.STOPPED_EXIT_CODE``). A launcher with
restarts left (torchrun ``--max-restarts``, an elastic agent, a Slurm requeue) takes that
for one more failure and starts the job again: a crash loop stopped by its ``CrashLoop``
alert, or a run an operator stopped, would be back within a minute, burning the
allocation the stop was meant to save.

So each actions pass looks for an attempt that the same launch began after a stop of the
whole run was done (its key is the launcher's id with a restart count: torchrun's
``TORCHELASTIC_RUN_ID``, Slurm's job id; the same id, a higher count). Such an attempt
gets a stop of its own, approved by the stop it follows, at once: its ranks stop after
their first steps, and the launcher spends its restarts on start-ups, not on training. A
new launch (another id, or the same ``--rdzv-id`` launched again: its count back at 0) is
a person starting the run again: it is left alone, as is an attempt whose launcher names
none.
"""

from __future__ import annotations

from sqlalchemy import Connection, select

from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.actions.records import create_action
from trainwarden.collector.store import models as m

WATCH_S = 6 * 3600.0
"""A stop is followed for this long after it was done."""
TRIGGER = "restart after stop"


def _launch(key: str | None) -> tuple[str, int] | None:
    """The launch an attempt key names (``torchelastic:ID``, ``slurm:JOB``) and its
    restart count, or None when the key has no count."""
    if not key or key.count(":") < 2:
        return None
    launch, _, count = key.rpartition(":")
    return (launch, int(count)) if count.isdigit() else None


def stop_restarts(conn: Connection, policy: ActionPolicy, *, now: float) -> list[int]:
    """Stop actions for the attempts a launcher began after a done stop of their run;
    returns their ids."""
    a, t = m.actions.c, m.attempts.c
    stops = conn.execute(
        select(a.id, a.run_id, a.finished_at)
        .where(
            a.kind == "stop",
            a.state == "done",
            a.mode != "dry-run",
            a.rank.is_(None),
            a.finished_at >= now - WATCH_S,
        )
        .order_by(a.id)
    ).all()
    made = []
    for stop in stops:
        attempts = conn.execute(
            select(t.number, t.key, t.started_at).where(t.run_id == stop.run_id).order_by(t.number)
        ).all()
        stopped = [x for x in attempts if x.started_at <= stop.finished_at]
        if not stopped:
            continue
        launch = _launch(stopped[-1].key)
        if launch is None:
            continue  # its launcher names no launch: a restart cannot be told from a launch
        for attempt in attempts:
            later = _launch(attempt.key)
            if (
                attempt.started_at <= stop.finished_at
                or later is None
                or later[0] != launch[0]
                or later[1] <= launch[1]  # the count back at 0: the same id launched again
            ):
                continue
            fingerprint = f"restart-after-stop:{stop.run_id}:{attempt.number}"
            if conn.execute(select(a.id).where(a.fingerprint == fingerprint)).first():
                continue
            made.append(
                create_action(
                    conn,
                    policy,
                    run_id=stop.run_id,
                    kind="stop",
                    now=now,
                    trigger=TRIGGER,
                    fingerprint=fingerprint,
                    detail=(
                        f"attempt {attempt.number} was started by the same launch after "
                        f"stop #{stop.id} stopped the run"
                    ),
                    mode="auto",
                    approver=f"stop #{stop.id}",
                )
            )
    return made
