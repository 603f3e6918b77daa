"""Preflight results (``tw.init(preflight=True)``, ``agent/preflight.py``): each rank's
checks before step 0 in the run's newest attempt, compared with its peers'.

A rank *fails* preflight with a hard fault (an uncorrectable ECC error, a pending row
remap or page retirement, a downgraded PCIe link, clocks held by a fault) or as an
outlier: its GEMM or (on a GPU) its memory copy under ``OUTLIER`` (0.85) times the
ranks' median, or its node's ranks together under that times the median node's (a node of
several ranks whose GPUs are all slow: cooling, power, the host's memory). The
all-reduce is the group's: every rank waits for the slowest, so it is shown, not
compared between ranks.
"""

from __future__ import annotations

import statistics
from typing import Any

from sqlalchemy import Connection, func, select

from trainwarden.collector.read.queries import run_id_of
from trainwarden.collector.store import models as m

KIND = "preflight"
OUTLIER = 0.85
"""A rank measured under this fraction of the median rank is an outlier."""
MEASURES = {"gemm_flops": "GEMM", "copy_bytes_per_s": "memory copy"}
JUDGED = {True: ("gemm_flops",)}
"""On a CPU only the GEMM is judged: one host's ranks copy at rates that differ by up to
0.82x the median between themselves (page placement; ``bench/results/preflight-cpu-2vcpu.txt``),
which the threshold would call a fault. On a GPU both are."""
SKEW_S = 60.0
"""A rank's preflight counts for the newest attempt if sent at most this long before the
attempt's start (the agents' clocks)."""


def newest(conn: Connection, run_id: int) -> tuple[int | None, dict[int, dict[str, Any]]]:
    """(the newest attempt's number, each rank's newest preflight of it)."""
    a, e = m.attempts.c, m.events.c
    attempt = conn.execute(
        select(a.number, a.started_at).where(a.run_id == run_id).order_by(a.number.desc()).limit(1)
    ).first()
    since = (attempt.started_at - SKEW_S) if attempt is not None else 0.0
    found: dict[int, dict[str, Any]] = {}
    for row in conn.execute(
        select(e.rank, e.ts, e.data)
        .where(e.run_id == run_id, e.kind == KIND, e.ts >= since, e.rank.is_not(None))
        .order_by(e.ts, e.id)
    ):
        found[int(row.rank)] = {"ts": row.ts, **(row.data or {})}
    return (attempt.number if attempt is not None else None), found


def _node_reasons(
    ranks: dict[int, dict[str, Any]], nodes: dict[int, str | None]
) -> dict[str | None, list[str]]:
    """Each node whose ranks' median is under ``OUTLIER`` times the median node's, with
    why; only when a node holds several ranks (else a node is a rank, judged as one)."""
    by_node: dict[str | None, list[dict[str, Any]]] = {}
    for rank, r in ranks.items():
        by_node.setdefault(nodes.get(rank), []).append(r)
    if len(by_node) < 2 or max(len(rs) for rs in by_node.values()) < 2:
        return {}
    out: dict[str | None, list[str]] = {}
    for key, what in MEASURES.items():
        medians = {}
        for node, rs in by_node.items():
            values = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
            cpu = any(r.get("device") == "cpu" for r in rs)
            if values and key in JUDGED.get(cpu, MEASURES):
                medians[node] = statistics.median(values)
        if len(medians) < 2:
            continue
        middle = statistics.median(medians.values())
        for node, value in medians.items():
            if middle and value / middle < OUTLIER:
                out.setdefault(node, []).append(
                    f"node {node}: {what} at {value / middle:.2f}x the median node's"
                )
    return out


def judge(
    ranks: dict[int, dict[str, Any]], nodes: dict[int, str | None] | None = None
) -> dict[int, dict[str, Any]]:
    """Each rank's result with its ratios to the median rank and its verdict: ``failed``
    and the ``reasons`` (or ``error``: it could not measure). With ``nodes`` (rank ->
    node), a node whose ranks are slow together fails them too."""
    slow_nodes = _node_reasons(ranks, nodes) if nodes else {}
    medians = {}
    for key in MEASURES:
        values = [r[key] for r in ranks.values() if isinstance(r.get(key), (int, float))]
        medians[key] = statistics.median(values) if values else None
    out = {}
    for rank, r in sorted(ranks.items()):
        reasons = list(r.get("faults") or [])
        ratios: dict[str, float | None] = {}
        for key, what in MEASURES.items():
            value, median = r.get(key), medians[key]
            ratio = value / median if isinstance(value, (int, float)) and median else None
            ratios[key] = ratio
            if key not in JUDGED.get(r.get("device") == "cpu", MEASURES):
                continue  # shown, not judged
            if ratio is not None and ratio < OUTLIER and len(ranks) > 1:
                reasons.append(f"{what} at {ratio:.2f}x the median rank's")
        reasons += slow_nodes.get((nodes or {}).get(rank), [])
        out[rank] = {
            **r,
            "rank": rank,
            "ratios": ratios,
            "failed": bool(reasons),
            "reasons": reasons,
        }
    return out


def nodes_of(conn: Connection, run_id: int) -> dict[int, str | None]:
    """Each rank's node (else its host)."""
    k = m.ranks.c
    query = select(k.rank, func.coalesce(k.node, k.host)).where(k.run_id == run_id)
    return {int(rank): node for rank, node in conn.execute(query)}


def results(conn: Connection, *, run: str) -> dict[str, Any]:
    """``GET /api/v1/runs/{run}/preflight``: the newest attempt's preflight, a rank a row
    (with its node), judged against its peers."""
    run_id = run_id_of(conn, run)
    attempt, ranks = newest(conn, run_id)
    nodes = nodes_of(conn, run_id)
    judged = judge(ranks, nodes)
    for rank, r in judged.items():
        r["node"] = nodes.get(rank)
    return {
        "run": run,
        "attempt": attempt,
        "outlier": OUTLIER,
        "ranks": list(judged.values()),
        "failed": sorted(rank for rank, r in judged.items() if r["failed"]),
    }
