"""One incident as the database holds it after a rollback drill, with chosen timestamps:
a loss spike injected at step 35, LossSpike pending and firing, a page delivered, a
rollback to the checkpoint of step 30 executed and done, training on from step 40.
The expected figures follow from these numbers (see ``EXPECTED``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, insert, select

from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from .helpers import batch, step

T0 = 1_700_000_000.0
RUN = "spiky"
FAULT_AT = T0 + 35.2
PENDING_AT = FIRING_AT = T0 + 36.0
PAGED_AT = T0 + 36.3 + 0.2  # attempt start + its duration: when the receiver answered
EXECUTING_AT = T0 + 37.0
DONE_AT = T0 + 39.0
RECOVERED_AT = T0 + 40.0  # step 40 is the first step after the rollback finished
EXPECTED = {
    "detect_s": PENDING_AT - FAULT_AT,
    "page_s": PAGED_AT - FIRING_AT,
    "act_s": EXECUTING_AT - FIRING_AT,
    "recover_s": RECOVERED_AT - FAULT_AT,
    "steps_lost": 40 - 30,
    # fault -> recovery, plus the 5 replayed steps (30 -> 35) that ran before the fault,
    # at the median step time (0.1 s)
    "time_lost_s": (RECOVERED_AT - FAULT_AT) + 5 * 0.1,
}


def make_run(engine: Engine, run: str = RUN, *, steps: int = 60) -> int:
    """A 2-rank run (ranks on node0 and node1) with ``steps`` steps rolled up."""
    with write(engine) as conn:
        for rank in (0, 1):
            body = batch(
                run, rank=rank, steps=[step(n, loss=2.0 - n / 100) for n in range(1, steps + 1)]
            )
            ingest(conn, batch=IngestBatch.model_validate(body), now=T0 + steps + 1)
    flush(engine, now=T0 + steps + 100, grace_s=0)
    with engine.connect() as conn:
        return int(conn.execute(select(m.runs.c.id).where(m.runs.c.name == run)).scalar_one())


def event(
    engine: Engine,
    run_id: int,
    kind: str,
    ts: float,
    *,
    step: int | None = None,
    rank: int | None = 0,
    data: dict[str, Any] | None = None,
    severity: str = "warning",
) -> None:
    with write(engine) as conn:
        conn.execute(
            insert(m.events).values(
                uid=f"{kind}:{ts}:{rank}",
                run_id=run_id,
                rank=rank,
                step=step,
                ts=ts,
                recv_ts=ts,
                kind=kind,
                severity=severity,
                data=data or {},
            )
        )


def alert(
    engine: Engine,
    run_id: int,
    *,
    rule: str = "LossSpike",
    rank: int = 0,
    active_since: float,
    fired_at: float | None,
    state: str = "firing",
    cleared_at: float | None = None,
    resolved_at: float | None = None,
    severity: str = "critical",
    step: int | None = None,
    action: str = "none",
    pending_step: int | None = None,
    fired_step: int | None = None,
) -> int:
    """``step``: the newest step the condition held at; ``pending_step`` / ``fired_step``:
    the run's step when it went pending / fired (default ``step``)."""
    with write(engine) as conn:
        return int(
            conn.execute(
                insert(m.alerts)
                .values(
                    fingerprint=f"{rule}{rank}{active_since}"[:32],
                    rule=rule,
                    run_id=run_id,
                    rank=rank,
                    node=f"node{rank}",
                    severity=severity,
                    state=state,
                    labels={"run": RUN, "rank": str(rank)},
                    annotations={
                        "summary": "The loss spiked.",
                        "description": f"loss x50 at step {step}",
                        "runbook_url": f"/runbooks/{rule}",
                    },
                    step=step,
                    active_since=active_since,
                    active_since_step=step if pending_step is None else pending_step,
                    fired_at=fired_at,
                    fired_at_step=(step if fired_step is None else fired_step)
                    if fired_at is not None
                    else None,
                    cleared_at=cleared_at,
                    resolved_at=resolved_at,
                    updated_at=active_since,
                    action=action,
                )
                .returning(m.alerts.c.id)
            ).scalar_one()
        )


def delivery(
    engine: Engine,
    alert_id: int,
    *,
    at: float,
    duration_s: float,
    ok: bool = True,
    status: str = "firing",
) -> None:
    with write(engine) as conn:
        conn.execute(
            insert(m.alert_deliveries).values(
                alert_id=alert_id,
                receiver="hook",
                kind="webhook",
                status=status,
                attempt=1,
                ok=int(ok),
                http_status=200 if ok else 500,
                at=at,
                duration_s=duration_s,
                final=1,
            )
        )


def action(
    engine: Engine,
    run_id: int,
    *,
    history: list[tuple[float, str]],
    alert_id: int | None,
    kind: str = "rollback",
    mode: str = "auto",
    result: dict[str, Any] | None = None,
    trigger: str = "rule:LossSpike",
) -> int:
    states = [s for _, s in history]
    with write(engine) as conn:
        return int(
            conn.execute(
                insert(m.actions)
                .values(
                    run_id=run_id,
                    kind=kind,
                    state=states[-1],
                    mode=mode,
                    trigger=trigger,
                    alert_id=alert_id,
                    history=[
                        {
                            "at": at,
                            "state": s,
                            "by": "policy" if s == "approved" else None,
                            "detail": None,
                        }
                        for at, s in history
                    ],
                    result=result,
                    created_at=history[0][0],
                    updated_at=history[-1][0],
                    finished_at=history[-1][0]
                    if states[-1] in ("done", "failed", "cancelled")
                    else None,
                )
                .returning(m.actions.c.id)
            ).scalar_one()
        )


def rollback_incident(engine: Engine) -> dict[str, int]:
    """The whole drill's rows; returns the ids."""
    run_id = make_run(engine)
    event(engine, run_id, "checkpoint", T0 + 30.05, step=30, data={"path": "/ckpt/step-30.pt"})
    event(
        engine,
        run_id,
        "drill",
        FAULT_AT,
        step=35,
        data={"fault": "loss_spike", "spec": "loss_spike=50x@step=35"},
    )
    alert_id = alert(
        engine,
        run_id,
        active_since=PENDING_AT,
        fired_at=FIRING_AT,
        state="resolved",
        cleared_at=T0 + 70.0,
        resolved_at=T0 + 75.0,
        step=39,
        pending_step=36,
        fired_step=37,
        action="rollback",
    )
    delivery(engine, alert_id, at=T0 + 36.3, duration_s=0.2)
    with write(engine) as conn:  # rank 0's GPU warms up a little through the incident
        conn.execute(
            insert(m.gpu_samples),
            [
                {
                    "run_id": run_id,
                    "rank": 0,
                    "ts": T0 + s,
                    "day": int((T0 + s) // 86400),
                    "recv_ts": T0 + s,
                    "temp_c": 60.0 + s / 10,
                }
                for s in range(0, 60, 2)
            ],
        )
    result = {
        "ranks": {
            str(r): {"barrier_step": 40, "checkpoint_step": 30, "seconds": 0.1, "at": DONE_AT}
            for r in (0, 1)
        }
    }
    action_id = action(
        engine,
        run_id,
        alert_id=alert_id,
        result=result,
        history=[
            (T0 + 36.5, "proposed"),
            (T0 + 36.5, "approved"),
            (EXECUTING_AT, "executing"),
            (T0 + 38.0, "executing"),
            (DONE_AT, "done"),
        ],
    )
    return {"run": run_id, "alert": alert_id, "action": action_id}
