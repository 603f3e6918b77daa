"""What the hardware page reads through the client at each refresh (the newest GPU
readings, XID events, the run's ranks), and the parts it draws of them."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from dash import dcc, html

from ...client import Client
from ...components import notice
from ..ranks.query import parse_query
from .figures import FIELDS, gpu_figure
from .panels import gpu_table, xid_rows, xid_table

SAMPLES = 20_000  # newest GPU readings drawn (the page stays quick on a big run)
GRAPHS = tuple(FIELDS)


def page_parts(client: Client, name: str, search: str | None, theme: str | None) -> tuple[Any, ...]:
    """(notice, GPU table, XID table, *graphs in GRAPHS order)."""
    rank, _, _ = parse_query(search)
    run = client.get_run(name)
    samples = client.gpu(name, rank=rank, limit=SAMPLES)
    events = client.events(name, kind="xid")
    if rank is not None:
        events = [e for e in events if e.rank == rank]
    note = None
    if rank is not None:
        everyone = f"/runs/{quote(name, safe='')}/hardware"
        note = html.Div(
            [f"Showing rank {rank}'s GPU only. ", dcc.Link("Show every GPU", href=everyone)],
            className="notice",
        )
    elif not samples:
        note = notice(
            "No GPU readings for this run yet. Each agent samples its GPU through NVML every "
            "TRAINWARDEN_GPU_INTERVAL seconds (5 by default); a host without an NVIDIA driver "
            "reports no telemetry, shown per rank below."
        )
    revision = f"{name}:{rank}"
    graphs = [gpu_figure(samples, key, theme=theme, revision=revision) for key in GRAPHS]
    xids = xid_rows(events, run.ranks)
    table = gpu_table(name, samples, run.ranks, selected=rank, xids=xids)
    return (note, table, xid_table(xids), *graphs)
