"""Repeat offenders (``collector/health/repeat_offenders.py``), on SQLite and PostgreSQL:
a running run with a rank on a node implicated in two other runs this week gets one
``repeat_offender_node`` event through the health evaluator; a cleared node, or one run's
findings, do not."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update

from trainwarden.collector.health.evaluator import evaluate
from trainwarden.collector.health.repeat_offenders import OffenderSettings, find
from trainwarden.collector.health.settings import HealthSettings
from trainwarden.collector.read import nodes
from trainwarden.collector.store import models as m

from ..node_findings import HOUR, NOW, add_alert, add_run

FRESH = OffenderSettings(every_s=0)  # read the records every pass


def fleet(engine: Any) -> int:
    """Runs a and b (finished) each with an XID on gpu-03; run c (running) on gpu-02 and
    gpu-03, with its ranks 1 and 2 on gpu-03."""
    with engine.begin() as conn:
        for name in ("a", "b"):
            run_id = add_run(conn, name, {0: "gpu-03"})
            add_alert(conn, run_id, "FatalXid", "gpu-03", NOW - 30 * HOUR, finding="xid")
            conn.execute(update(m.runs).where(m.runs.c.id == run_id).values(status="finished"))
        return add_run(conn, "c", {0: "gpu-02", 1: "gpu-03", 2: "gpu-03"})


def test_a_run_on_a_node_two_runs_found_bad_is_warned_once(engine) -> None:  # type: ignore[no-untyped-def]
    run_c = fleet(engine)
    with engine.begin() as conn:
        for _ in range(2):
            evaluate(conn, now=NOW, settings=HealthSettings(offenders=FRESH))
    with engine.connect() as conn:
        e = m.events.c
        said = conn.execute(
            select(e.run_id, e.rank, e.kind, e.data).where(e.kind == "repeat_offender_node")
        ).all()
    assert [(r.run_id, r.rank) for r in said] == [(run_c, 1)]  # its lowest rank there, once
    data = said[0].data
    assert (data["node"], data["runs"], data["kinds"]) == ("gpu-03", 2, {"xid": 2})
    assert data["reason"].startswith("node gpu-03 was implicated in 2 runs in the last 7 days")


def test_a_cleared_node_or_one_runs_findings_are_not_a_repeat(engine) -> None:  # type: ignore[no-untyped-def]
    run_c = fleet(engine)
    with engine.begin() as conn:
        assert list(find(conn, [run_c], now=NOW, settings=FRESH)) == [run_c]
        assert find(conn, [run_c], now=NOW, settings=OffenderSettings(runs=3, every_s=0)) == {}
        nodes.clear(conn, "gpu-03", by="ana", note="GPU replaced", now=NOW)
        assert find(conn, [run_c], now=NOW, settings=FRESH) == {}
