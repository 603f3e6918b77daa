"""What the runs list reads through the client at each refresh: the runs, and the count
of each one's firing alerts, as the table."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from dash import dcc, html

from trainwarden.collector.read.queries import RUN_STATUS_HELP

from ...client import Client
from ...components import ago, notice


def runs_table(client: Client) -> Any:
    runs = client.list_runs()
    if not runs:
        return notice(
            "No runs yet. Add the agent to a trainer (tw.init(run=..., url=...)) "
            "or start `trainwarden demo`; runs appear here within seconds."
        )
    firing: dict[str, int] = {}
    for a in client.alerts(states=["firing"], limit=10_000):
        firing[a.run] = firing.get(a.run, 0) + 1
    header = html.Tr(
        [
            html.Th(h)
            for h in (
                "Run",
                "Status",
                "Firing alerts",
                "World size",
                "Ranks seen",
                "Last step",
                "Updated",
            )
        ]
    )
    rows = [
        html.Tr(
            [
                html.Td(dcc.Link(r.name, href=f"/runs/{r.name}", className="run-link")),
                html.Td(
                    html.Span(
                        r.status,
                        className=f"status status-{r.status}",
                        title=RUN_STATUS_HELP.get(r.status, ""),
                    )
                ),
                html.Td(
                    dcc.Link(
                        str(firing[r.name]),
                        href=f"/alerts?run={quote(r.name)}&state=firing",
                        className="firing-count",
                    )
                    if r.name in firing
                    else "—"
                ),
                html.Td(r.world_size),
                html.Td(r.ranks_seen),
                html.Td("—" if r.last_step is None else r.last_step),
                html.Td(ago(r.updated_at)),
            ]
        )
        for r in runs
    ]
    return html.Table([html.Thead(header), html.Tbody(rows)], className="runs-table")
