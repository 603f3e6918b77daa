"""What the writer's tests share: ``node`` is a node relay's columnar batch of 8 ranks,
``rows`` counts the rank steps stored."""

from __future__ import annotations

from sqlalchemy import func, select

from trainwarden.collector.ingest.schema_columns import ColumnarBatch
from trainwarden.collector.store import models as m


def node(
    rank0: int, steps: range, *, duration: float = 0.5, run: str = "w", world: int = 64
) -> ColumnarBatch:
    ranks = range(rank0, rank0 + 8)
    cols: dict[str, list[object]] = {"rank": [], "step": [], "ts": [], "duration_s": []}
    for s in steps:
        for r in ranks:
            cols["rank"].append(r)
            cols["step"].append(s)
            cols["ts"].append(1_700_000_000.0 + s)
            cols["duration_s"].append(duration)
    agents = [{"rank": r, "host": f"n{rank0}", "session": f"s{r}"} for r in ranks]
    return ColumnarBatch.model_validate(
        {"run": run, "world_size": world, "agents": agents, "steps": cols}
    )


def rows(engine) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(m.rank_steps)).scalar_one()
