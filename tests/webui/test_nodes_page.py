"""The nodes pages (``/nodes``, ``/nodes/<name>``) on a real database, through the
in-process client and the app's own callbacks: each node with findings in the last 7
days, a spark of when, and one node's findings linked to their runs at their steps."""

from __future__ import annotations

from typing import Any

from trainwarden.collector.read import nodes
from trainwarden.webui.app import create_dash, page
from trainwarden.webui.client import LocalClient
from trainwarden.webui.components import ago
from trainwarden.webui.pages.nodes.data import node_record, nodes_table, run_href, spark

from ..collector.node_findings import HOUR, NOW, add_alert, add_event, add_run
from .dash_call import dash_call
from .helpers import text, walk

DAY = 24 * HOUR


def fleet(engine: Any) -> LocalClient:
    with engine.begin() as conn:
        a = add_run(conn, "run-a", {0: "gpu-01", 1: "gpu-03"})
        b = add_run(conn, "run/b", {0: "gpu-03"})
        add_alert(conn, a, "FatalXid", "gpu-03", NOW - 2 * DAY, finding="xid")
        add_event(
            conn,
            b,
            "hang_verdict",
            NOW - HOUR,
            {"kind": "culprit", "culprits": [0], "summary": "rank 0 never entered all_reduce"},
        )
        add_alert(conn, a, "Straggler", "gpu-01", NOW - 3 * DAY, finding="straggler")
    return LocalClient(engine)


def test_the_list_names_each_node_with_its_runs_kinds_and_when(engine) -> None:  # type: ignore[no-untyped-def]
    table = nodes_table(fleet(engine), now=NOW)
    rows = [c for c in walk(table) if getattr(c, "className", "") == "node-row"]
    assert [text(r) for r in rows] == [
        "gpu-03 2 2 hang 1, xid 1 ····█·█ 60 min ago",
        f"gpu-01 1 1 straggler 1 ···█··· {ago(NOW - 3 * DAY, NOW)}",
    ]
    links = [c.href for c in walk(table) if getattr(c, "className", "") == "node-link"]
    assert links == ["/nodes/gpu-03", "/nodes/gpu-01"]


def test_a_nodes_page_links_each_finding_to_its_run_at_its_step(engine) -> None:  # type: ignore[no-untyped-def]
    client = fleet(engine)
    shown = node_record(client, "gpu-03", now=NOW)
    hrefs = [c.href for c in walk(shown) if hasattr(c, "href")]
    assert hrefs == ["/runs/run%2Fb?from=0&to=62", "/runs/run-a?from=0&to=90"]  # newest first
    assert "rank 0 never entered all_reduce" in text(shown)
    with engine.begin() as conn:
        nodes.clear(conn, "gpu-03", by="ana", note="GPU replaced", now=NOW)
    cleared = node_record(client, "gpu-03", now=NOW)
    assert "Cleared" in text(cleared) and "ana: GPU replaced" in text(cleared)
    assert "(before the node was cleared)" in text(cleared)
    assert "No findings on node nowhere" in text(node_record(client, "nowhere", now=NOW))


def test_the_pages_are_routed_and_refreshed_by_their_callbacks(engine) -> None:  # type: ignore[no-untyped-def]
    client = fleet(engine)
    assert "Nodes" in text(page("/nodes", None, client=client, refresh_s=2))
    assert "gpu-03" in text(page("/nodes/gpu-03", None, client=client, refresh_s=2))
    app = create_dash(client)
    got = dash_call(app, "nodes-table.children", {}, ["nodes-interval.n_intervals"])
    assert "gpu-03" in str(got["nodes-table"]["children"])
    got = dash_call(
        app, "node-record.children", {"node-name.data": "gpu-01"}, ["node-interval.n_intervals"]
    )
    assert "straggler" in str(got["node-record"]["children"])


def test_a_spark_is_a_character_a_day_oldest_first() -> None:
    assert spark([], now=NOW) == "·······"
    assert spark([NOW - HOUR, NOW - HOUR, NOW - 3 * DAY, NOW - 30 * DAY], now=NOW) == "···▄··█"
    assert run_href("r", None) == "/runs/r" and run_href("r", 10) == "/runs/r?from=0&to=60"
