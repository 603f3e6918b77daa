"""The ranks page's tables, as pure functions of query results: the rank states (the
counts, then a row per rank linking to its detail) and one rank's facts and events."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from dash import dcc, html

from trainwarden.collector.read.schemas import EventOut, GpuSample, RankInfo

# Rank states in the order a reader triages them; the collector's health pass sets them.
STATES = ("dead", "hung", "slow", "evicted", "running", "healthy", "finished")
STATE_HELP = {
    "dead": "no heartbeat: the process is gone or its node is unreachable",
    "hung": "heartbeats arrive but no step completes",
    "slow": "completes steps, slower than its peers",
    "evicted": "its node was taken out of the job",
    "running": "reporting; not yet judged",
    "healthy": "in step with its peers",
    "finished": "ended its run cleanly",
}
RANK_ROWS = 64  # the states table lists every rank up to this; past it, only the unhealthy
QUIET = ("healthy", "running", "finished")  # states a long list need not show


def state_counts(ranks: Sequence[RankInfo]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in ranks:
        counts[r.state] = counts.get(r.state, 0) + 1
    order = {s: i for i, s in enumerate(STATES)}
    return dict(sorted(counts.items(), key=lambda kv: order.get(kv[0], -1)))


def rank_href(run: str, rank: int, search: str = "") -> str:
    return f"/runs/{quote(run, safe='')}/ranks?{search + '&' if search else ''}rank={rank}"


def states_table(
    run: str, ranks: Sequence[RankInfo], *, selected: int | None, keep: str = ""
) -> html.Div:
    """State counts, then a row per rank (past RANK_ROWS ranks, only the unhealthy ones)
    linking to its detail; ``keep`` is the query string the links carry (the range)."""
    if not ranks:
        return html.Div(html.P("No rank has reported yet.", className="hint"))
    chips = [
        html.Span(
            f"{n} {state}", className=f"status status-{state}", title=STATE_HELP.get(state, "")
        )
        for state, n in state_counts(ranks).items()
    ]
    # Past RANK_ROWS ranks, only those in trouble, and at most RANK_ROWS of them: a table
    # of thousands of rows takes the browser minutes to draw (Dash renders each cell).
    shown = list(ranks) if len(ranks) <= RANK_ROWS else [r for r in ranks if r.state not in QUIET]
    order = {s: i for i, s in enumerate(STATES)}
    shown.sort(key=lambda r: (order.get(r.state, -1), r.rank))
    shown = shown[:RANK_ROWS]
    rows = []
    for r in shown:
        detail = r.state_detail or {}
        role = f"{detail['role']}: " if detail.get("role") else ""
        rows.append(
            html.Tr(
                [
                    html.Td(
                        dcc.Link(
                            str(r.rank), href=rank_href(run, r.rank, keep), className="rank-link"
                        )
                    ),
                    html.Td(r.node or r.host or "—"),
                    html.Td(html.Span(r.state, className=f"status status-{r.state}")),
                    html.Td(role + str(detail.get("reason", "")), className="detail"),
                    html.Td("—" if r.last_step is None else r.last_step),
                ],
                className="rank-row rank-selected" if r.rank == selected else "rank-row",
                id=f"ranks-row-{r.rank}",
            )
        )
    hidden = len(ranks) - len(shown)
    note = (
        html.P(
            f"{hidden} ranks not listed (the healthy first); click a heatmap row for any rank.",
            className="hint",
        )
        if hidden
        else None
    )
    table = (
        html.Table(
            [
                html.Thead(html.Tr([html.Th(h) for h in ("Rank", "Node", "State", "Why", "Step")])),
                html.Tbody(rows),
            ],
            className="runs-table ranks-table",
        )
        if rows
        else None
    )
    return html.Div([html.Div(chips, className="state-chips"), table, note])


def rank_facts(info: RankInfo, gpu: GpuSample | None, events: Sequence[EventOut]) -> html.Div:
    """Who the rank is, its state and why, its GPU now, and its latest events."""
    detail = info.state_detail or {}
    facts: list[tuple[str, Any]] = [
        ("state", html.Span(info.state, className=f"status status-{info.state}")),
        ("node", info.node or info.host or "—"),
        ("local rank", "—" if info.local_rank is None else str(info.local_rank)),
        ("pid", "—" if info.pid is None else str(info.pid)),
        ("last step", "—" if info.last_step is None else str(info.last_step)),
    ]
    if detail.get("reason"):
        facts.append(("why", str(detail["reason"])))
    if gpu is not None:
        parts = [gpu.gpu_name or "GPU"]
        if gpu.temp_c is not None:
            parts.append(f"{gpu.temp_c:.0f} °C")
        if gpu.throttle:
            parts.append("throttled: " + ", ".join(gpu.throttle))
        if gpu.simulated:
            parts.append("(simulated)")
        facts.append(("GPU", " · ".join(parts)))
    items = [
        html.Li(
            [
                html.Span(e.kind, className="fact-key"),
                html.Span(_event_line(e), className=f"sev-{e.severity}"),
            ]
        )
        for e in list(events)[-6:][::-1]
    ]
    return html.Div(
        [
            html.Div(
                [
                    html.Span([html.Span(k, className="fact-key"), v], className="fact")
                    for k, v in facts
                ],
                className="facts",
            ),
            html.Ul(items, className="events") if items else None,
        ]
    )


def _event_line(e: EventOut) -> str:
    d = e.data or {}
    step = f"step {e.step}: " if e.step is not None else ""
    if e.kind == "xid":
        return f"{step}XID {d.get('code')} {d.get('name', '')}: {d.get('meaning', '')}"
    if e.kind == "rank_state":
        return f"{step}{d.get('from')} → {d.get('to')}" + (
            f": {d['reason']}" if d.get("reason") else ""
        )
    if e.kind == "drill":
        return f"{step}drill injected: {d.get('spec') or d.get('fault')}"
    if e.kind == "rank_conflict":  # which processes collide: pid, node, session of each
        return f"duplicate rank: {d.get('reason', '')}"
    return step + ", ".join(f"{k}={v}" for k, v in list(d.items())[:4])
