"""What the alert engine's tests share: ``send`` stores a rank's batch at a chosen time,
``Engine`` runs an AlertEngine over chosen rules with a controlled clock and records
what it would send, ``straggling`` makes one of three ranks slow."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from trainwarden.alerts import load_rule_packs
from trainwarden.collector.alerting.engine import AlertEngine, EngineSettings
from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.limits import Pressure
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import batch, step

T0 = 1_700_000_000.0


RULES = {r.name: r for r in load_rule_packs()}


EXTERNAL = "https://tw.example.org"


def send(engine, *, rank: int, at: float, world: int = 2, steps=(), events=(), node=None) -> None:  # type: ignore[no-untyped-def]
    body = batch(rank=rank, world_size=world, steps=list(steps), events=list(events))
    done = [s["step"] for s in steps]
    body["agent"].update(
        heartbeat_s=2.0,
        sent_at=at,
        last_step=max(done) if done else None,
        last_step_end=at if done else None,
        node=node or f"node{rank // 2}",
    )
    with write(engine) as conn:
        ingest(conn, batch=IngestBatch.model_validate(body), now=at)


def xid(code: int, at: float, uid: str) -> dict[str, Any]:
    return {"id": uid, "kind": "xid", "ts": at, "severity": "critical", "data": {"code": code}}


class Engine:
    """An AlertEngine over a chosen set of rules, recording what it would send."""

    def __init__(self, engine, *names: str, **settings: Any) -> None:  # type: ignore[no-untyped-def]
        self.sent: list[Any] = []
        self.engine = engine
        self.names = names
        self.settings = EngineSettings(**settings)
        self.pressure: Pressure | None = None
        self.alerts = self._new()

    def _new(self) -> AlertEngine:
        return AlertEngine(
            self.engine,
            [RULES[n] for n in self.names],
            settings=self.settings,
            external_url=EXTERNAL,
            submit=self.sent.append,
            pressure=self.pressure,
        )

    def restart(self) -> None:
        self.alerts = self._new()

    def run(self, now: float) -> list[dict[str, Any]]:
        flush(self.engine, now=now, grace_s=0)
        self.alerts.run_once(now=now)
        with self.engine.connect() as conn:
            return [
                dict(r._mapping) for r in conn.execute(select(m.alerts).order_by(m.alerts.c.id))
            ]


def straggling(engine, first: int, last: int, *, at: float, slow_rank: int = 1) -> None:  # type: ignore[no-untyped-def]
    for rank in (0, 1, 2):
        compute = 0.3 if rank == slow_rank else 0.1
        steps = [{**step(n, duration=compute), "compute_s": compute} for n in range(first, last)]
        send(engine, rank=rank, world=3, at=at, steps=steps)
