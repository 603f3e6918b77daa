"""Runs, ranks, alerts and events that implicate nodes, written straight into the
database: what ``collector/read/nodes.py`` reads a node's record from."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import insert

from trainwarden.collector.store import models as m

NOW = time.time()
HOUR = 3600.0


def add_run(conn: Any, name: str, nodes: dict[int, str]) -> int:
    run_id = conn.execute(
        insert(m.runs).values(name=name, world_size=len(nodes), created_at=NOW, updated_at=NOW)
    ).inserted_primary_key[0]
    for rank, node in nodes.items():
        conn.execute(
            insert(m.ranks).values(
                run_id=run_id,
                rank=rank,
                node=node,
                host=node,
                session=f"{name}-{rank}",
                first_seen=NOW,
                last_seen=NOW,
            )
        )
    return int(run_id)


def add_alert(conn: Any, run_id: int, rule: str, node: str, at: float, **labels: str) -> None:
    conn.execute(
        insert(m.alerts).values(
            fingerprint=f"{rule}{run_id}{node}{at}"[:32],
            rule=rule,
            run_id=run_id,
            rank=1,
            node=node,
            severity="critical",
            state="firing",
            labels={"category": "hardware", **labels},
            annotations={"description": f"{rule} on {node}"},
            active_since=at,
            fired_at=at,
            onset_step=40,
            updated_at=at,
        )
    )


def add_event(
    conn: Any,
    run_id: int,
    kind: str,
    at: float,
    data: dict[str, Any],
    *,
    rank: int | None = None,
    step: int | None = 12,
) -> None:
    conn.execute(
        insert(m.events).values(
            uid=f"{kind}-{run_id}-{rank}-{at}",
            run_id=run_id,
            rank=rank,
            ts=at,
            recv_ts=at,
            kind=kind,
            severity="critical",
            step=step,
            data=data,
        )
    )


def add_eviction(conn: Any, run_id: int, node: str, at: float, *, mode: str = "auto") -> None:
    conn.execute(
        insert(m.actions).values(
            run_id=run_id,
            kind="evict",
            state="done",
            mode=mode,
            trigger="rule:FatalXid",
            node=node,
            history=[],
            created_at=at,
            updated_at=at,
        )
    )
