"""Every node's record across runs: the findings that implicated it, from what the
collector already keeps.

- **Alerts** whose rule carries a ``finding`` label (the shipped pack: FatalXid ``xid``,
  EccUncorrectable ``ecc``, GpuThermalThrottle and GpuOverTemperature ``thermal``,
  Straggler ``straggler``, SilentDataCorruption and RankLossDivergence ``sdc``), on the
  node of the rank they fired for. A rule of one's own joins by carrying the label.
- **Evictions** (``evict`` actions that ran, not dry runs): ``eviction``.
- **Hang culprits** (a ``hang_verdict`` naming culprit ranks, or a desync): ``hang``, on
  each culprit rank's node.
- **Crash loops** (``crash_loop`` events) whose attempts failed on the same node:
  ``crash_loop``.

A node is named as the agents report it (the scheduler's name: ``SLURMD_NODENAME``,
``NODE_NAME``, else the host name). ``trainwarden nodes clear`` marks one repaired
(``node_clearances``): its findings before that stay on its record, marked cleared, and
no longer count.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from sqlalchemy import Connection, func, insert, select

from trainwarden.collector.store import models as m
from trainwarden.collector.store.errors import Invalid

FINDING_LABEL = "finding"
"""The rule label that makes its alerts findings against their node, and names the kind."""
DAY_S = 86_400.0


def _alert_findings(conn: Connection, since: float, node: str | None) -> list[dict[str, Any]]:
    a, r = m.alerts.c, m.runs.c
    query = (
        select(
            a.node,
            a.rule,
            a.labels,
            a.rank,
            a.fired_at,
            a.fired_at_step,
            a.onset_step,
            a.annotations,
            r.name.label("run"),
        )
        .join(m.runs, r.id == a.run_id)
        .where(a.node.is_not(None), a.fired_at.is_not(None), a.fired_at >= since)
    )
    if node is not None:
        query = query.where(a.node == node)
    out = []
    for row in conn.execute(query):
        kind = (row.labels or {}).get(FINDING_LABEL)
        if not kind:
            continue
        step = row.onset_step if row.onset_step is not None else row.fired_at_step
        out.append(
            {
                "node": row.node,
                "kind": kind,
                "run": row.run,
                "rank": row.rank,
                "step": step,
                "at": row.fired_at,
                "source": f"alert {row.rule}",
                "detail": (row.annotations or {}).get("description") or row.rule,
            }
        )
    return out


def _eviction_findings(conn: Connection, since: float, node: str | None) -> list[dict[str, Any]]:
    a, r = m.actions.c, m.runs.c
    query = (
        select(a.id, a.node, a.rank, a.state, a.reason, a.created_at, r.name.label("run"))
        .join(m.runs, r.id == a.run_id)
        .where(
            a.kind == "evict",
            a.node.is_not(None),
            a.mode != "dry-run",
            a.state.in_(("executing", "done", "failed")),
            a.created_at >= since,
        )
    )
    if node is not None:
        query = query.where(a.node == node)
    return [
        {
            "node": row.node,
            "kind": "eviction",
            "run": row.run,
            "rank": row.rank,
            "step": None,
            "at": row.created_at,
            "source": f"action {row.id}",
            "detail": f"evicted ({row.state})" + (f": {row.reason}" if row.reason else ""),
        }
        for row in conn.execute(query)
    ]


def _event_findings(conn: Connection, since: float, node: str | None) -> list[dict[str, Any]]:
    e, r = m.events.c, m.runs.c
    rows = conn.execute(
        select(e.run_id, e.kind, e.step, e.ts, e.data, r.name.label("run"))
        .join(m.runs, r.id == e.run_id)
        .where(e.kind.in_(("hang_verdict", "crash_loop")), e.ts >= since)
    ).all()
    nodes_of: dict[int, dict[int, str | None]] = {}
    out = []
    for row in rows:
        data = row.data or {}
        if row.kind == "hang_verdict":
            if data.get("kind") not in ("culprit", "desync"):
                continue
            if row.run_id not in nodes_of:
                k = m.ranks.c
                nodes_of[row.run_id] = dict(
                    conn.execute(
                        select(k.rank, func.coalesce(k.node, k.host)).where(k.run_id == row.run_id)
                    ).all()
                )
            culprits = [int(c) for c in data.get("culprits") or ()]
            found: dict[str | None, int | None] = {nodes_of[row.run_id].get(c): c for c in culprits}
            what = str(data.get("summary") or "hang culprit")
            kind = "hang"
        else:
            found = {n: None for n in data.get("nodes") or ()}
            what, kind = str(data.get("reason") or "crash loop"), "crash_loop"
        for name, rank in found.items():
            if name is None or (node is not None and name != node):
                continue
            out.append(
                {
                    "node": name,
                    "kind": kind,
                    "run": row.run,
                    "rank": rank,
                    "step": row.step,
                    "at": row.ts,
                    "source": f"event {row.kind}",
                    "detail": what,
                }
            )
    return out


def _clearances(conn: Connection, node: str | None = None) -> dict[str, dict[str, Any]]:
    """The newest clearance of each node (of ``node`` only, when given)."""
    c = m.node_clearances.c
    query = select(c.node, c.cleared_at, c.by, c.note).order_by(c.cleared_at)
    if node is not None:
        query = query.where(c.node == node)
    return {row.node: dict(row._mapping) for row in conn.execute(query)}


def findings(conn: Connection, *, since: float, node: str | None = None) -> list[dict[str, Any]]:
    """Every finding since ``since`` (of ``node`` only, when given), oldest first, each
    marked ``cleared`` when its node was marked repaired after it."""
    found = (
        _alert_findings(conn, since, node)
        + _eviction_findings(conn, since, node)
        + _event_findings(conn, since, node)
    )
    cleared = _clearances(conn, node)
    for f in found:
        mark = cleared.get(f["node"])
        f["cleared"] = mark is not None and f["at"] <= mark["cleared_at"]
    return sorted(found, key=lambda f: (f["at"], f["node"], f["kind"]))


def nodes(conn: Connection, *, now: float, days: float = 7.0) -> list[dict[str, Any]]:
    """``GET /api/v1/nodes``: each node with findings in the last ``days`` that still
    count, most runs first (then most findings, then the newest)."""
    if not days > 0:
        raise Invalid(f"days must be positive, got {days}")
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for f in findings(conn, since=now - days * DAY_S):
        if not f["cleared"]:
            by_node[f["node"]].append(f)
    cleared = _clearances(conn)
    out = [
        {
            "node": name,
            "findings": len(found),
            "runs": len({f["run"] for f in found}),
            "kinds": dict(Counter(f["kind"] for f in found)),
            "first_at": found[0]["at"],
            "last_at": found[-1]["at"],
            "times": [f["at"] for f in found],
            "cleared_at": (cleared.get(name) or {}).get("cleared_at"),
        }
        for name, found in by_node.items()
    ]
    return sorted(out, key=lambda n: (-n["runs"], -n["findings"], -n["last_at"], n["node"]))


def record(conn: Connection, node: str, *, now: float, days: float = 90.0) -> dict[str, Any]:
    """``GET /api/v1/nodes/{node}``: its findings across runs (oldest first, cleared ones
    marked) and its clearances."""
    if not days > 0:
        raise Invalid(f"days must be positive, got {days}")
    c = m.node_clearances.c
    clearances = [
        dict(row._mapping)
        for row in conn.execute(
            select(c.cleared_at, c.by, c.note).where(c.node == node).order_by(c.cleared_at)
        )
    ]
    return {
        "node": node,
        "findings": findings(conn, since=now - days * DAY_S, node=node),
        "clearances": clearances,
    }


def clear(conn: Connection, node: str, *, by: str, note: str, now: float) -> dict[str, Any]:
    """Mark ``node`` repaired now: its findings so far no longer count against it."""
    if not node.strip():
        raise Invalid("name the node to clear")
    if not note.strip():
        raise Invalid("say why the node is cleared (--note): what was repaired")
    row = {"node": node, "cleared_at": now, "by": by[:128], "note": note[:2000]}
    conn.execute(insert(m.node_clearances).values(**row))
    return row


def elsewhere(
    conn: Connection, *, run: str, names: set[str], now: float, days: float = 7.0
) -> list[dict[str, Any]]:
    """The nodes among ``names`` (a run's) with findings that still count in *other* runs
    of the last ``days``: for a post-mortem's "this node was implicated in N other runs"."""
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for f in findings(conn, since=now - days * DAY_S):
        if f["node"] in names and f["run"] != run and not f["cleared"]:
            by_node[f["node"]].append(f)
    out = []
    for name, found in sorted(by_node.items()):
        runs = sorted({f["run"] for f in found})
        kinds = dict(Counter(f["kind"] for f in found))
        said = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
        out.append(
            {
                "node": name,
                "runs": runs,
                "findings": len(found),
                "kinds": kinds,
                "summary": (
                    f"{name} was implicated in {len(runs)} other "
                    f"run{'s' if len(runs) > 1 else ''} in the {days:g} days before this "
                    f"report ({said}): {', '.join(runs)}"
                ),
            }
        )
    return out
