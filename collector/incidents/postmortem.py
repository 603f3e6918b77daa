"""Post-mortem reports: a run's incidents with their timelines and figures, as Markdown
(GitHub or Slack flavour), a self-contained HTML page with Plotly charts of each
incident's window (plotly.js inline: it opens offline), or JSON for tools; and posting
a report to a Slack-compatible or generic webhook.

``report_of`` reads the database and returns plain data; the renderers are pure
functions of it, so the CLI renders what it fetched from a collector
(``GET /api/v1/runs/{run}/postmortem?format=json``) exactly as the collector would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select

from trainwarden.collector.incidents.report_format import (
    CHART_METRICS,
    GOODPUT_KEYS,
    crash_report,
    render_json,
    render_markdown,
)
from trainwarden.collector.incidents.report_html import render_html
from trainwarden.collector.incidents.store import list_incidents
from trainwarden.collector.incidents.timeline import DEFINITIONS, timeline
from trainwarden.collector.ingest import crashes, endings
from trainwarden.collector.read import nodes as node_records
from trainwarden.collector.read import preflight
from trainwarden.collector.read.economics import EconomicsSettings, goodput
from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.store import models as m

CHART_POINTS = 2000
MAX_CRASHES = 100


# -- gathering -------------------------------------------------------------------------------


def report_of(
    conn: Connection,
    *,
    run: str,
    incident_id: int | None = None,
    price_per_gpu_hour: float | None = None,
    base_url: str = "",
    now: float | None = None,
    charts: bool = True,
) -> dict[str, Any]:
    """The post-mortem of ``run``: every incident (or only ``incident_id``), each with its
    timeline, derived figures and the chart data of its window; plus the run's notes."""
    now = time.time() if now is None else now
    ru = conn.execute(select(m.runs).where(m.runs.c.name == run)).first()
    if ru is None:
        raise NotFound(f"run {run!r} not found")
    ids = (
        [incident_id]
        if incident_id is not None
        else [i["id"] for i in list_incidents(conn, run=run)]
    )
    incidents = []
    for i in ids:
        t = timeline(
            conn,
            run=run,
            incident_id=i,
            now=now,
            price_per_gpu_hour=price_per_gpu_hour,
            base_url=base_url,
        )
        if charts:
            t["charts"] = chart_data(
                conn,
                run_id=ru.id,
                start=t["window"]["start"],
                end=t["window"]["end"],
                ranks=t["incident"]["ranks"],
            )
        incidents.append(t)
    nodes = {
        r.rank: r.node
        for r in conn.execute(
            select(m.ranks.c.rank, m.ranks.c.node).where(m.ranks.c.run_id == ru.id)
        )
    }
    n = m.notes.c
    notes = [
        {"at": r.at, "author": r.author, "text": r.text, "step": r.step, "incident": r.incident_id}
        for r in conn.execute(select(m.notes).where(n.run_id == ru.id).order_by(n.at, n.id))
    ]
    e = m.events.c
    crashed = [
        {
            "rank": r.rank,
            "node": nodes.get(r.rank),
            "at": r.ts,
            "step": r.step,
            **dict(r.data or {}),
        }
        for r in conn.execute(
            select(e.rank, e.ts, e.step, e.data)
            .where(e.run_id == ru.id, e.kind == crashes.KIND)
            .order_by(e.ts, e.id)
            .limit(MAX_CRASHES)
        )
    ]
    good = goodput(
        conn, ru.id, settings=EconomicsSettings(price_per_gpu_hour=price_per_gpu_hour), now=now
    )
    return {
        "kind": "trainwarden.postmortem",
        "version": 1,
        "generated_at": now,
        "run": {
            "name": ru.name,
            "world_size": ru.world_size,
            "status": ru.status,
            "created_at": ru.created_at,
            "updated_at": ru.updated_at,
            "last_step": ru.last_step,
        },
        # How the job ended, when it died in a collective verdict or a crash: said first.
        "story": endings.story(conn, ru.id),
        "goodput": {k: good[k] for k in GOODPUT_KEYS},
        "incident_filter": incident_id,
        "price_per_gpu_hour": price_per_gpu_hour,
        "incidents": incidents,
        "notes": notes,
        # Ranks that died of a signal: their last words, sent by survivors of their node.
        "crashes": [crash_report(c) for c in crashed],
        # The newest attempt's checks before step 0, when it ran them: who failed and why.
        "preflight": preflight_summary(conn, ru.name),
        # The run's nodes that other runs found bad this week (docs/nodes.md).
        "nodes_elsewhere": node_records.elsewhere(
            conn, run=ru.name, names={n for n in nodes.values() if n}, now=now
        ),
        "definitions": DEFINITIONS,
    }


def preflight_summary(conn: Connection, run: str) -> dict[str, Any] | None:
    """The run's preflight for a report: how many ranks ran it, and each that failed with
    its node and reasons; None when it ran none."""
    found = preflight.results(conn, run=run)
    if not found["ranks"]:
        return None
    failed = [r for r in found["ranks"] if r["failed"]]
    n, attempt = len(found["ranks"]), found["attempt"]
    when = f" (attempt {attempt})" if attempt is not None else ""
    return {
        "attempt": attempt,
        "ranks": n,
        "failed": [
            {"rank": r["rank"], "node": r.get("node"), "reasons": r["reasons"]} for r in failed
        ],
        "summary": (
            f"{len(failed)} of {n} ranks failed preflight{when}"
            if failed
            else f"all {n} ranks passed preflight{when}"
        ),
    }


def _thin(rows: Sequence[Any], points: int) -> list[Any]:
    stride = max(1, -(-len(rows) // points))
    return list(rows[::stride])


def chart_data(
    conn: Connection,
    *,
    run_id: int,
    start: float,
    end: float,
    ranks: list[int],
    points: int = CHART_POINTS,
) -> dict[str, Any]:
    """Loss, step time and MFU across ranks (median, min, max per step) and the GPU
    temperature of the involved ranks (all ranks, up to 8, when none is named) over
    ``start``..``end``."""
    s = m.step_stats.c
    out: dict[str, Any] = {}
    for metric, _label in CHART_METRICS:
        rows = conn.execute(
            select(s.step, s.ts, s.median, s.min, s.max)
            .where(s.run_id == run_id, s.metric == metric, s.ts >= start, s.ts <= end)
            .order_by(s.ts, s.step)
        ).all()
        kept = _thin(rows, points)
        out[metric] = {
            k: [getattr(r, k) for r in kept] for k in ("step", "ts", "median", "min", "max")
        }
    g = m.gpu_samples.c
    chosen = (
        list(ranks)
        or sorted(conn.execute(select(m.ranks.c.rank).where(m.ranks.c.run_id == run_id)).scalars())[
            :8
        ]
    )
    temp: dict[str, Any] = {}
    for rank in chosen:
        samples = conn.execute(
            select(g.ts, g.temp_c)
            .where(g.run_id == run_id, g.rank == rank, g.ts >= start, g.ts <= end)
            .order_by(g.ts)
        ).all()
        kept = _thin(samples, points)
        temp[str(rank)] = {"ts": [r.ts for r in kept], "temp_c": [r.temp_c for r in kept]}
    out["temp_c"] = temp
    return out


# -- HTML --------------------------------------------------------------------------------------


def render(report: dict[str, Any], fmt: str) -> str:
    if fmt == "md":
        return render_markdown(report)
    if fmt == "html":
        return render_html(report)
    if fmt == "json":
        return render_json(report)
    raise ValueError(f"format {fmt!r}: use md, html or json")
