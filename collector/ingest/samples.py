"""Writing sample digests: on a step where the trainer called ``s.samples(ids)``, each
rank's digest of its sample ids and their count (``sample_digests``). A later execution
of the step (a replay after a rollback, a restart) replaces digest and count; the first
execution's digest stays in ``first_digest``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from trainwarden.collector.store import models as m
from trainwarden.collector.store.bulk import upsert_rows

_KEY = ("run_id", "step", "rank")


def _later(table: Any, new: Any) -> Any:
    return table.c.ts < new.ts


def _overwrite(table: Any, new: Any) -> dict[str, Any]:
    return {name: new[name] for name in ("ts", "recv_ts", "digest", "count")}


def digests_of(run_id: int, steps: dict[str, list[Any]], now: float) -> list[dict[str, Any]]:
    """The rows of a request's step columns that carry a sample digest."""
    digests = steps.get("samples_digest")
    if not digests or not any(digests):
        return []
    counts = steps.get("samples_count") or [None] * len(digests)
    return [
        {
            "run_id": run_id,
            "step": steps["step"][i],
            "rank": steps["rank"][i],
            "ts": steps["ts"][i],
            "recv_ts": now,
            "digest": digest,
            "count": counts[i] or 0,
            "first_digest": digest,
        }
        for i, digest in enumerate(digests)
        if digest is not None
    ]


def write_digests(conn: Connection, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    latest: dict[tuple[int, int, int], dict[str, Any]] = {}
    for row in rows:  # the same step twice in one flush: its later execution
        key = (row["run_id"], row["step"], row["rank"])
        if key not in latest:
            latest[key] = row
        elif row["ts"] >= latest[key]["ts"]:
            latest[key] = {**row, "first_digest": latest[key]["first_digest"]}
        else:
            latest[key] = {**latest[key], "first_digest": row["digest"]}
    upsert_rows(
        conn, m.sample_digests, list(latest.values()), key=_KEY, set_=_overwrite, where=_later
    )
