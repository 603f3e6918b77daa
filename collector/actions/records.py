"""Action rows: creating one (approved, proposed or planned as a dry run by the policy),
its history and events, the commands sent for it and the ranks' acknowledgements, and
what it did in a line (``summary``)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, func, insert, select, update

from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.actions.rollback import rollback_plan
from trainwarden.collector.store import models as m
from trainwarden.collector.store.action_plans import Plan

ACTIVE = ("proposed", "approved", "executing")


LIVE_RANKS = ("healthy", "slow", "hung", "running")


def history_with(
    row: Any, state: str, by: str | None, detail: str | None, now: float
) -> list[dict[str, Any]]:
    return [*(row.history or []), {"at": now, "state": state, "by": by, "detail": detail}]


def summary(kind: str, state: str, result: dict[str, Any] | None, reason: str | None) -> str:
    """What an action did, in a line (the UI's actions table, the demo's closing list):
    what a dry run would have done, what a done one did, else why it failed or waits."""
    result = result or {}
    if result.get("dry_run"):
        would = dict(result.get("would") or {})
        extra = ""
        if kind == "evict" and would.get("backend") is None:
            would.pop("backend", None)
            extra = " (no eviction backend is configured)"
        what = ", ".join(f"{k} {v}" for k, v in would.items() if v not in (None, [], {}, ""))
        problem = f"; problem: {result['problem']}" if result.get("problem") else ""
        return f"dry run, nothing done; would {kind}: {what}{extra}{problem}"
    if state in ("failed", "cancelled") and reason:
        return reason
    if state != "done" or not result:
        return reason or "—"
    if kind == "rollback" and result.get("ranks"):
        ranks = [r for r in result["ranks"].values() if isinstance(r, dict)]
        at = sorted(
            {str(r["checkpoint_step"]) for r in ranks if r.get("checkpoint_step") is not None}
        )
        after = sorted({str(r["barrier_step"]) for r in ranks if r.get("barrier_step") is not None})
        took = result.get("restored_within_s")
        earlier = [str(r.get("checkpoint_step")) for r in result.get("restores") or []]
        return (
            f"every rank ({len(ranks)}) restored the checkpoint of step {', '.join(at)} "
            f"after step {', '.join(after)}"
            + (f", {took} s after the commit" if took is not None else "")
            + (f" (the restore of step {', '.join(earlier)} had not fixed it)" if earlier else "")
            + (f"; {result['check']}" if result.get("check") else "")
        )
    if kind == "evict" and result.get("node"):
        stopped = result.get("ranks_stopped") or []
        return (
            f"node {result['node']} evicted ({'; '.join(result.get('steps') or [])}); "
            f"ranks stopped: {stopped or 'none'}"
        )
    if kind == "stop" and "stopped" in result:
        gone, silent = result.get("already_gone") or [], result.get("no_answer") or []
        return (
            f"ranks stopped: {result['stopped'] or 'none'}"
            + (f"; already gone: {gone}" if gone else "")
            + (f"; no answer: {silent}" if silent else "")
        )
    return ", ".join(f"{k} {v}" for k, v in result.items())


def create_action(
    conn: Connection,
    policy: ActionPolicy,
    *,
    run_id: int,
    kind: str,
    now: float,
    trigger: str,
    alert_id: int | None = None,
    fingerprint: str | None = None,
    rank: int | None = None,
    node: str | None = None,
    detail: str | None = None,
    mode: str | None = None,
    approver: str | None = None,
    plan: Plan | None = None,
) -> int:
    """A new action: approved at once under ``auto`` (or when an operator asks), left
    proposed under ``require-ack``, planned and closed under ``dry-run``."""
    mode = mode or policy.of(kind).mode
    state = {"auto": "approved", "require-ack": "proposed", "dry-run": "approved"}[mode]
    if approver is not None and mode == "require-ack":
        state = "approved"
    history = [{"at": now, "state": "proposed", "by": trigger, "detail": detail}]
    if state == "approved":
        history.append(
            {
                "at": now,
                "state": "approved",
                "by": approver or ("policy" if mode == "auto" else "dry-run"),
                "detail": None,
            }
        )
    action_id = conn.execute(
        insert(m.actions)
        .values(
            run_id=run_id,
            kind=kind,
            state=state,
            mode=mode,
            trigger=trigger,
            alert_id=alert_id,
            fingerprint=fingerprint,
            rank=rank,
            node=node,
            approver=approver or ("policy" if state == "approved" and mode == "auto" else None),
            plan=plan.dump() if plan is not None else None,
            reason=detail[:2000] if detail else None,
            history=history,
            created_at=now,
            updated_at=now,
        )
        .returning(m.actions.c.id)
    ).scalar_one()
    if mode == "dry-run":
        _dry_run(conn, policy, action_id, now)
        state = "done"
    store_events(
        conn,
        [
            {
                "run_id": run_id,
                "kind": "action",
                "severity": "warning",
                "rank": rank,
                "data": {
                    "action": action_id,
                    "type": kind,
                    "state": state,
                    "trigger": trigger,
                    "mode": mode,
                },
            }
        ],
        now,
    )
    return action_id


def _dry_run(conn: Connection, policy: ActionPolicy, action_id: int, now: float) -> None:
    row = conn.execute(select(m.actions).where(m.actions.c.id == action_id)).one()
    if row.kind == "rollback":
        plan, problem = rollback_plan(conn, row, policy.rollback)
        would = plan.rollback.dump() if plan and plan.rollback else None
    elif row.kind == "evict":
        would, problem = (
            {"node": row.node, "backend": (policy.evict.backend or {}).get("backend")},
            None,
        )
    else:
        would, problem = (
            {"ranks": [row.rank] if row.rank is not None else live_ranks(conn, row.run_id)},
            None,
        )
    result = {"dry_run": True, "would": would, "problem": problem}
    conn.execute(
        update(m.actions)
        .where(m.actions.c.id == action_id)
        .values(
            state="done",
            result=result,
            finished_at=now,
            updated_at=now,
            history=history_with(
                row,
                "done",
                "dry-run",
                "dry run: nothing was done" + (f" ({problem})" if problem else ""),
                now,
            ),
        )
    )


def live_ranks(conn: Connection, run_id: int) -> list[int]:
    k = m.ranks.c
    return sorted(
        conn.execute(select(k.rank).where(k.run_id == run_id, k.state.in_(LIVE_RANKS))).scalars()
    )


def gone_ranks(conn: Connection, run_id: int, ranks: Sequence[int]) -> set[int]:
    if not ranks:  # every rank answered: nothing to ask the database
        return set()
    k = m.ranks.c
    return set(
        conn.execute(
            select(k.rank).where(
                k.run_id == run_id,
                k.rank.in_(list(ranks)),
                k.state.in_(("dead", "finished", "failed")),
            )
        ).scalars()
    )


def restarted_since(conn: Connection, run_id: int, ts: float) -> int | None:
    """The number of the run's newest attempt if it began after ``ts`` (a restart: the
    processes of then are gone), else None."""
    a = m.attempts.c
    return conn.execute(
        select(func.max(a.number)).where(a.run_id == run_id, a.started_at > ts)
    ).scalar()


def queue_commands(
    conn: Connection, row: Any, ranks: Sequence[int], body: dict[str, Any], now: float
) -> None:
    if not ranks:  # an empty executemany would insert one row of defaults (and fail)
        return
    conn.execute(
        insert(m.agent_commands),
        [
            {"action_id": row.id, "run_id": row.run_id, "rank": r, "body": body, "created_at": now}
            for r in ranks
        ],
    )


def rank_acks(conn: Connection, row: Any, *, since: float, phase: str) -> dict[int, dict[str, Any]]:
    """Each rank's latest acknowledgement (``command_ack`` events) of this action's
    commands of ``phase`` (prepare, stop) sent since ``since``: a rollback's commit or
    abort is acknowledged under the id of the prepare it decides."""
    c = m.agent_commands.c
    ids = {
        i
        for i, body, at in conn.execute(
            select(c.id, c.body, c.created_at).where(c.action_id == row.id)
        )
        if at >= since and (body.get("phase") or body.get("type")) == phase
    }
    e = m.events.c
    out: dict[int, dict[str, Any]] = {}
    for rank, step, ts, recv_ts, data in conn.execute(
        select(e.rank, e.step, e.ts, e.recv_ts, e.data)
        .where(e.run_id == row.run_id, e.kind == "command_ack", e.recv_ts >= since)
        .order_by(e.id)
    ):
        if (data or {}).get("command") in ids and rank is not None:
            out[rank] = {**data, "step": step, "at": recv_ts, "ts": ts}
    return out


def action_event(row: Any, state: str, detail: str | None, now: float) -> dict[str, Any]:
    return {
        "run_id": row.run_id,
        "kind": "action",
        "severity": "critical" if state == "failed" else "warning",
        "rank": row.rank,
        "data": {
            "action": row.id,
            "type": row.kind,
            "state": state,
            "trigger": row.trigger,
            "detail": detail,
        },
    }


def store_events(conn: Connection, events: list[dict[str, Any]], now: float) -> None:
    if events:
        conn.execute(
            insert(m.events),
            [
                {"uid": f"action:{uuid.uuid4().hex}", "ts": now, "recv_ts": now, "step": None, **ev}
                for ev in events
            ],
        )
