"""What the nodes pages read through the client, as tables: the list with each node's
findings by kind and a spark of when, and one node's findings across runs, each linked
to its run's page at that step."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

from dash import dcc, html

from ...client import Client
from ...components import ago, notice

DAYS = 7
SPARK = "▁▂▃▄▅▆▇█"
AROUND = 50  # steps either side of a finding on its run's page


def spark(times: list[float], *, now: float, days: int = DAYS) -> str:
    """A character a day, oldest first: how many findings fell on it (blank: none)."""
    counts = [0] * days
    for ts in times:
        back = int((now - ts) // 86_400)
        if 0 <= back < days:
            counts[days - 1 - back] += 1
    top = max(counts) or 1
    return "".join(
        "·" if n == 0 else SPARK[min(len(SPARK) - 1, (n * len(SPARK) - 1) // top)] for n in counts
    )


def nodes_table(client: Client, *, now: float | None = None) -> Any:
    now = time.time() if now is None else now
    found = client.nodes(days=DAYS)
    if not found:
        return notice(
            f"No node has findings in the last {DAYS} days that still count: no XID, ECC "
            "error, throttle, straggler, hang culprit, SDC suspect, crash loop or eviction "
            "(or each was cleared)."
        )
    header = html.Tr(
        [html.Th(h) for h in ("Node", "Runs", "Findings", "By kind", f"Last {DAYS} days", "Last")]
    )
    rows = [
        html.Tr(
            [
                html.Td(
                    dcc.Link(
                        n["node"], href=f"/nodes/{quote(n['node'], safe='')}", className="node-link"
                    )
                ),
                html.Td(n["runs"]),
                html.Td(n["findings"]),
                html.Td(", ".join(f"{k} {c}" for k, c in sorted(n["kinds"].items()))),
                html.Td(
                    spark(n["times"], now=now),
                    className="spark",
                    title="a character a day, oldest first",
                ),
                html.Td(ago(n["last_at"], now)),
            ],
            className="node-row",
        )
        for n in found
    ]
    return html.Table([html.Thead(header), html.Tbody(rows)], className="nodes-table")


def run_href(run: str, step: int | None) -> str:
    """The run's page, at ``step`` when there is one."""
    href = f"/runs/{quote(run, safe='')}"
    if step is None:
        return href
    return f"{href}?from={max(0, step - AROUND)}&to={step + AROUND}"


def node_record(client: Client, name: str, *, now: float | None = None) -> Any:
    now = time.time() if now is None else now
    record = client.node(name)
    parts: list[Any] = []
    for c in reversed(record["clearances"]):
        parts.append(
            notice(f"Cleared {ago(c['cleared_at'], now)} by {c['by']}: {c['note']}", "info")
        )
    if not record["findings"]:
        parts.append(notice(f"No findings on node {name} in the last 90 days."))
        return parts
    header = html.Tr([html.Th(h) for h in ("When", "Kind", "Run", "Rank", "Step", "What")])
    rows = [
        html.Tr(
            [
                html.Td(ago(f["at"], now)),
                html.Td(f["kind"]),
                html.Td(dcc.Link(f["run"], href=run_href(f["run"], f["step"]))),
                html.Td("—" if f["rank"] is None else f["rank"]),
                html.Td("—" if f["step"] is None else f["step"]),
                html.Td(f["detail"] + (" (before the node was cleared)" if f["cleared"] else "")),
            ],
            className="finding-row finding-cleared" if f["cleared"] else "finding-row",
        )
        for f in reversed(record["findings"])  # the newest first
    ]
    parts.append(html.Table([html.Thead(header), html.Tbody(rows)], className="node-findings"))
    return parts
