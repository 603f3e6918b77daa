"""A rollback's plan: where the anomaly began (its onset, from the data), which
checkpoints are clean (``clean_limit``: step <= onset - 2 - margin), the newest clean one
to restore and the data window to skip; and the run's checkpoints marked good or suspect."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Connection, select

from trainwarden.alerts.rules import action_kinds
from trainwarden.collector.actions.policy import RollbackPolicy
from trainwarden.collector.store import models as m
from trainwarden.collector.store.action_plans import Restore, RollbackPlan, RollbackSpec


def rollback_plan(
    conn: Connection, row: Any, pol: RollbackPolicy
) -> tuple[RollbackPlan | None, str | None]:
    """The newest checkpoint before the anomaly's onset and the data to skip (the end of
    the window is set again at commit, from the barrier)."""
    run = conn.execute(select(m.runs).where(m.runs.c.id == row.run_id)).one()
    onset_step, onset_ts = run.last_step or 0, math.inf
    exact = None
    stored = RollbackPlan.of(row.plan)
    given = stored.checkpoint_step
    below = stored.below_step  # a restore of it did not fix the anomaly
    if row.alert_id is not None:
        alert = conn.execute(select(m.alerts).where(m.alerts.c.id == row.alert_id)).one()
        onset_step = onset_of(alert) or onset_step
        onset_ts = alert.active_since
        exact = clean_through(alert)
    e = m.events.c
    ckpts = [
        (s, ts, (d or {}).get("path"))
        for s, ts, d in conn.execute(
            select(e.step, e.ts, e.data).where(
                e.run_id == row.run_id, e.kind == "checkpoint", e.step.is_not(None)
            )
        )
    ]
    if given is not None:
        good = [c for c in ckpts if c[0] == given]
        if not good:
            return (
                None,
                f"no checkpoint of step {given} was reported (known: "
                f"{sorted({c[0] for c in ckpts})})",
            )
    else:
        limit = clean_limit(onset_step, pol.margin_steps) if exact is None else exact
        if below is not None:
            limit = min(limit, below - 1)
        # Not one another anomaly made suspect either (saved after an earlier spike's
        # onset, say, which a restart resumed from: resumes.py).
        suspect = {
            (c["step"], c["ts"])
            for c in checkpoints(conn, row.run_id, margin_steps=pol.margin_steps)
            if not c["good"]
        }
        good = [
            c for c in ckpts if c[0] <= limit and c[1] < onset_ts and (c[0], c[1]) not in suspect
        ]
        if not good:
            known = sorted({c[0] for c in ckpts})[-5:]
            older = f", older than step {below}" if below is not None else ""
            return None, (
                f"no checkpoint at or before step {limit} ("
                + (
                    f"onset {onset_step} - 2 - margin {pol.margin_steps}"
                    if exact is None
                    else "the last step the alert's data proves clean"
                )
                + f"{older}); "
                f"reported: {known or 'none (call tw.checkpoint_saved)'}"
            )
    step, _, path = max(good, key=lambda c: (c[0], c[1]))
    newest = max(
        (
            r
            for (r,) in conn.execute(
                select(m.ranks.c.last_step).where(m.ranks.c.run_id == row.run_id)
            )
            if r is not None
        ),
        default=run.last_step or 0,
    )
    # An alert whose data proves where clean checkpoints end (silent data corruption: the
    # parameters went wrong, not the data) replays the same batches at the same learning
    # rate: no data window is skipped (an empty one: skip_to < skip_from), no lr scale.
    keep_data = exact is not None
    plan = RollbackPlan(
        issued_at_step=newest,
        onset_step=onset_step,
        keep_data=keep_data,
        rollback=RollbackSpec(
            checkpoint_step=step,
            checkpoint_path=path or "",
            skip_from=step + 1,
            skip_to=step if keep_data else newest + pol.skip_margin_steps,
            lr_scale=None if keep_data else pol.lr_scale,
            reason=f"{row.trigger}: onset at step {onset_step}",
        ),
    )
    return plan, None


def onset_of(alert: Any) -> int | None:
    """Where an alert's anomaly began: its onset in the data (``onset_step``); for an alert
    stored before that was kept, the earliest step a pass saw it at."""
    if alert.onset_step is not None:
        return int(alert.onset_step)
    steps = [s for s in (alert.step, alert.active_since_step) if s is not None]
    return min(steps) if steps else None


def clean_through(alert: Any) -> int | None:
    """The newest step whose checkpoint an alert's own data proves clean, if it says
    (``SilentDataCorruption``: the last check at which the replicas' parameters agreed;
    no margin is needed for an exact check)."""
    value = (getattr(alert, "annotations", None) or {}).get("clean_through")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def clean_limit(onset_step: int, margin_steps: int) -> int:
    """The newest checkpoint step that is clean for an anomaly whose onset is step
    ``onset_step``. A checkpoint reported as ``tw.checkpoint_saved(s)`` holds the weights
    after the update of step s; the loss of step k is computed with the weights after
    update k - 1, so the update that caused an anomaly seen at k is k - 1 at the latest,
    and a checkpoint is clean iff s <= k - 2. ``margin_steps`` more for safety."""
    return onset_step - 2 - margin_steps


def not_fixed(restore: Restore) -> str:
    steps = restore.steps
    on = f" (steps {steps[0]}-{steps[-1]} run again)" if len(steps) == 2 else ""
    return (
        f"the restore of the checkpoint of step {restore.checkpoint_step} did not fix "
        f"it{on}: {restore.detail}"
    )


def _restored(result: Any, finished_at: float) -> float:
    """When the last rank restored, in a rollback's result (its last restore), on the
    ranks' clock (``ts``: what a checkpoint's time is compared with; a checkpoint saved
    at the first step after the restore can reach the collector before the restore's
    acknowledgement does), else on the collector's (``at``); else when it ended."""
    ranks = [r for r in ((result or {}).get("ranks") or {}).values() if isinstance(r, dict)]
    for key in ("ts", "at"):
        times = [float(r[key]) for r in ranks if r.get(key)]
        if times and len(times) == len(ranks):
            return max(times)
    return float(finished_at)


def checkpoints(conn: Connection, run_id: int, *, margin_steps: int) -> list[dict[str, Any]]:
    """The checkpoints the trainer reported (``tw.checkpoint_saved``), oldest first, each
    good or suspect. Suspect: saved before an anomaly whose rule rolls back (LossSpike,
    NonFiniteLoss, ...) or whose data says where clean checkpoints end (``clean_through``:
    SilentDataCorruption) had cleared, and either while it was active or of a step past
    its clean limit (``clean_through``, else :func:`clean_limit`: onset - 2 -
    ``margin_steps``). Once the anomaly cleared, or once every rank restored in a rollback
    of it that was done (its check found the anomaly gone), new checkpoints are good."""
    a = m.alerts.c
    anomalies = conn.execute(
        select(
            a.id,
            a.rule,
            a.active_since,
            a.cleared_at,
            a.step,
            a.active_since_step,
            a.onset_step,
            a.annotations,
            a.action,
        )
        .where(a.run_id == run_id, a.active_since.is_not(None))
        .order_by(a.active_since)
    ).all()
    # Those that roll back, and those whose data proves where the clean checkpoints end
    # (SilentDataCorruption), whatever their action.
    anomalies = [
        al
        for al in anomalies
        if "rollback" in action_kinds(al.action) or clean_through(al) is not None
    ]
    # Rollbacks that restored and were found to have fixed it (done, not a dry run): what
    # the trainer saved after every rank restored holds the restored weights.
    x = m.actions.c
    restores = [
        (r.created_at, _restored(r.result, r.finished_at))
        for r in conn.execute(
            select(x.created_at, x.finished_at, x.result).where(
                x.run_id == run_id,
                x.kind == "rollback",
                x.state == "done",
                x.mode != "dry-run",
                x.finished_at.is_not(None),
            )
        )
    ]

    def restored_at(al: Any) -> float | None:
        """When every rank had restored, in a rollback of this anomaly that was done (one
        made for it or for an alert of the same episode, within a minute)."""
        done = [at for made, at in restores if made >= al.active_since - 60]
        return min(done) if done else None

    fixed = {al.id: restored_at(al) for al in anomalies}
    e = m.events.c
    out = []
    for step, ts, rank, data in conn.execute(
        select(e.step, e.ts, e.rank, e.data)
        .where(e.run_id == run_id, e.kind == "checkpoint", e.step.is_not(None))
        .order_by(e.ts, e.id)
    ):
        data = dict(data or {})
        suspect = None
        for al in anomalies:
            onset = onset_of(al)
            if al.cleared_at is not None and ts >= al.cleared_at:
                continue
            if fixed[al.id] is not None and ts >= fixed[al.id]:
                continue  # saved after the restore of a rollback that fixed it
            exact = clean_through(al)
            limit = exact if exact is not None else None
            if limit is None and onset is not None:
                limit = clean_limit(onset, margin_steps)
            if ts >= al.active_since or (limit is not None and step > limit):
                suspect = f"saved before {al.rule} (alert {al.id}, onset at step {onset}) cleared"
                break
        out.append(
            {
                "step": step,
                "path": data.pop("path", None),
                "ts": ts,
                "rank": rank,
                "meta": data,
                "good": suspect is None,
                "suspect": suspect,
            }
        )
    return out
