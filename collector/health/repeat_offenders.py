"""Repeat offenders: a running run on a node that other runs already found bad.

Every 10 s the health evaluator reads the nodes' records (``collector/read/nodes.py``)
of the last ``days`` and, for each running run with a rank on a node implicated in at
least ``runs`` runs (findings that still count: not cleared), stores one
``repeat_offender_node`` event on the run's lowest rank on that node, naming the node, its
runs and its findings. The ``RepeatOffenderNode`` rule pages on it (a warning): the job is
on a node the fleet remembers, before it costs this run too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, func, select

from trainwarden.collector.read import nodes
from trainwarden.collector.store import models as m

KIND = "repeat_offender_node"


@dataclass(frozen=True)
class OffenderSettings:
    runs: int = 2
    """Implicated in at least this many runs ..."""
    days: float = 7.0
    """... within this many days."""
    every_s: float = 10.0
    """How often the records are read again (a pass in between uses the last reading)."""


_read: dict[Engine, tuple[float, dict[str, dict[str, Any]]]] = {}


def _offenders(conn: Connection, now: float, settings: OffenderSettings) -> dict[str, Any]:
    """The nodes implicated in ``settings.runs`` runs or more, read at most every
    ``every_s`` (per database)."""
    kept = _read.get(conn.engine)
    if kept is None or now - kept[0] >= settings.every_s:
        found = {
            n["node"]: n
            for n in nodes.nodes(conn, now=now, days=settings.days)
            if n["runs"] >= settings.runs
        }
        kept = _read[conn.engine] = (now, found)
    return kept[1]


def find(
    conn: Connection, run_ids: Iterable[int], *, now: float, settings: OffenderSettings
) -> dict[int, list[dict[str, Any]]]:
    """Each running run's ``repeat_offender_node`` events (their uid makes each once per run
    and node)."""
    offenders = _offenders(conn, now, settings)
    ids = list(run_ids)
    if not offenders or not ids:
        return {}
    k = m.ranks.c
    where = func.coalesce(k.node, k.host)
    rows = conn.execute(
        select(k.run_id, where.label("node"), func.min(k.rank).label("rank"))
        .where(k.run_id.in_(ids), where.in_(list(offenders)))
        .group_by(k.run_id, where)
    ).all()
    out: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        record = offenders[row.node]
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(record["kinds"].items()))
        out.setdefault(row.run_id, []).append(
            {
                "uid": f"{KIND}:{row.run_id}:{row.node}",
                "kind": KIND,
                "rank": row.rank,
                "step": None,
                "severity": "warning",
                "data": {
                    "node": row.node,
                    "runs": record["runs"],
                    "findings": record["findings"],
                    "kinds": record["kinds"],
                    "reason": (
                        f"node {row.node} was implicated in {record['runs']} runs in the last "
                        f"{settings.days:g} days ({record['findings']} findings: {kinds}); see "
                        f"GET /api/v1/nodes/{row.node}"
                    ),
                },
            }
        )
    return out
