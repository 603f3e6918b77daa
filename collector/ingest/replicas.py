"""Writing replica fingerprints: on a checked step, each rank's fingerprint of its
parameters and its replica group (``replica_checks``), and on a probed step its
determinism probe (the output's fingerprint and sums, and their tolerance). A later
execution of the step (a rollback or restart ran it again) replaces the earlier one's,
and its group's earlier comparison is dropped, to be made again on what the replay
sent."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, delete, select, tuple_

from trainwarden.collector.store import models as m
from trainwarden.collector.store.bulk import upsert_rows

_KEY = ("run_id", "step", "rank")


def _later(table: Any, new: Any) -> Any:
    return table.c.ts < new.ts


def _overwrite(table: Any, new: Any) -> dict[str, Any]:
    return {name: new[name] for name in _COLUMNS}


_COLUMNS = ("ts", "recv_ts", "replica_group", "fingerprint", "probe", "probe_sums", "probe_rtol")


def checks_of(run_id: int, steps: dict[str, list[Any]], now: float) -> list[dict[str, Any]]:
    """The rows of a request's step columns that carry a fingerprint."""
    prints = steps.get("fingerprint")
    if not prints or not any(prints):
        return []
    none = [None] * len(prints)
    groups = steps.get("replica_group") or none
    probes = steps.get("probe") or none
    sums = steps.get("probe_sums") or none
    rtols = steps.get("probe_rtol") or none
    return [
        {
            "run_id": run_id,
            "step": steps["step"][i],
            "rank": steps["rank"][i],
            "ts": steps["ts"][i],
            "recv_ts": now,
            "replica_group": groups[i] or "",
            "fingerprint": fp,
            "probe": probes[i],
            "probe_sums": sums[i] if probes[i] is not None else None,
            "probe_rtol": rtols[i] if probes[i] is not None else None,
        }
        for i, fp in enumerate(prints)
        if fp is not None
    ]


def write_checks(conn: Connection, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    latest: dict[tuple[int, int, int], dict[str, Any]] = {}
    for row in rows:  # the same step twice in one flush: its later execution
        key = (row["run_id"], row["step"], row["rank"])
        if key not in latest or row["ts"] >= latest[key]["ts"]:
            latest[key] = row
    rows = list(latest.values())
    # Which of them are new, or a later execution: only their steps are compared again
    # (a batch delivered twice changes nothing).
    c, keys = m.replica_checks.c, list(latest)
    stored: dict[tuple[int, int, int], float] = {}
    for at in range(0, len(keys), 500):
        for run_id, step, rank, ts in conn.execute(
            select(c.run_id, c.step, c.rank, c.ts).where(
                tuple_(c.run_id, c.step, c.rank).in_(keys[at : at + 500])
            )
        ):
            stored[(run_id, step, rank)] = ts
    upsert_rows(conn, m.replica_checks, rows, key=_KEY, set_=_overwrite, where=_later)
    r = m.replica_results.c
    pairs = sorted(
        {
            (key[0], key[1])
            for key, row in latest.items()
            if key not in stored or stored[key] < row["ts"]
        }
    )
    for at in range(0, len(pairs), 500):
        conn.execute(
            delete(m.replica_results).where(tuple_(r.run_id, r.step).in_(pairs[at : at + 500]))
        )
