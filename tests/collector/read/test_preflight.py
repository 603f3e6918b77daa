"""Judging the ranks' preflight results (``collector/read/preflight.py``) and the health
pass's ``preflight_failed`` events (``collector/health/preflight.py``), on SQLite and
PostgreSQL: an outlier against the median rank once its peers are in, a hard fault at
once, each said once an attempt."""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert

from trainwarden.collector.health import preflight as verdicts
from trainwarden.collector.incidents.postmortem import render, report_of
from trainwarden.collector.read.preflight import judge, results
from trainwarden.collector.store import models as m

from ..node_findings import NOW, add_event, add_run


def measured(gemm: float = 1e10, copy: float = 5e9, **more: Any) -> dict[str, Any]:
    return {"gemm_flops": gemm, "copy_bytes_per_s": copy, "faults": [], **more}


def test_an_outlier_under_the_median_and_a_hard_fault_fail() -> None:
    got = judge(
        {
            0: measured(),
            1: measured(gemm=1.05e10),
            2: measured(gemm=0.5e10),
            3: measured(copy=5.2e9, faults=["PCIe link at x8 of x16"]),
        }
    )
    assert [r["failed"] for r in got.values()] == [False, False, True, True]
    assert got[2]["reasons"] == ["GEMM at 0.50x the median rank's"]
    assert got[3]["reasons"] == ["PCIe link at x8 of x16"]
    assert round(got[2]["ratios"]["gemm_flops"], 3) == 0.5
    assert judge({0: measured(gemm=1.0)})[0]["failed"] is False  # alone: no peers


def pre(conn: Any, run_id: int, rank: int, at: float, **data: Any) -> None:
    add_event(conn, run_id, "preflight", at, measured(**data), rank=rank, step=None)


def test_a_fault_is_said_at_once_an_outlier_once_every_rank_is_in(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        run_id = add_run(conn, "p", {r: f"node-{r}" for r in range(4)})
        conn.execute(
            insert(m.attempts).values(run_id=run_id, number=1, started_at=NOW - 10, nodes=[])
        )
        pre(conn, run_id, 0, NOW)
        pre(conn, run_id, 1, NOW, gemm=0.4e10)  # an outlier: waits for its peers
        pre(conn, run_id, 3, NOW, faults=["1 uncorrectable ECC error"])
        first = verdicts.failures(conn, run_id, 4, now=NOW + 1)
        assert [(e["rank"], e["data"]["reasons"]) for e in first] == [
            (3, ["1 uncorrectable ECC error"])
        ]
        pre(conn, run_id, 2, NOW + 2)
        second = verdicts.failures(conn, run_id, 4, now=NOW + 3)
        assert [e["rank"] for e in second] == [1, 3]  # rank 3's uid is the same: stored once
        assert (
            second[0]["data"]["reason"]
            == "rank 1 failed preflight: GEMM at 0.40x the median rank's"
        )
        assert verdicts.failures(conn, run_id, 4, now=NOW + 4) == []  # judged whole
        shown = results(conn, run="p")
    assert (shown["attempt"], shown["failed"]) == (1, [1, 3])
    assert [r["node"] for r in shown["ranks"]] == ["node-0", "node-1", "node-2", "node-3"]


def test_a_rank_that_never_reports_is_not_waited_for_past_wait_s(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        run_id = add_run(conn, "q", {0: "a", 1: "b", 2: "c"})
        pre(conn, run_id, 0, NOW)
        pre(conn, run_id, 1, NOW, copy=1e9)
        assert verdicts.failures(conn, run_id, 3, now=NOW + 5) == []
        late = verdicts.failures(conn, run_id, 3, now=NOW + verdicts.WAIT_S + 1)
    assert [e["rank"] for e in late] == [1]


def test_on_a_cpu_the_copy_is_shown_not_judged() -> None:
    cpu = {r: measured(device="cpu") for r in range(3)}
    cpu[1] = measured(device="cpu", copy=3e9)  # 0.6x: within a host's spread on a CPU
    cpu[2] = measured(device="cpu", gemm=0.5e10)
    got = judge(cpu)
    assert [r["failed"] for r in got.values()] == [False, False, True]
    assert round(got[1]["ratios"]["copy_bytes_per_s"], 2) == 0.6


def test_a_post_mortem_says_who_failed_preflight(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        run_id = add_run(conn, "p", {r: f"node-{r}" for r in range(3)})
        pre(conn, run_id, 0, NOW)
        pre(conn, run_id, 1, NOW, gemm=0.4e10)
        pre(conn, run_id, 2, NOW)
        add_run(conn, "none", {0: "node-0"})
    with engine.connect() as conn:
        report = report_of(conn, run="p", now=NOW, charts=False)
        assert report_of(conn, run="none", now=NOW, charts=False)["preflight"] is None
    said = report["preflight"]
    assert said["summary"] == "1 of 3 ranks failed preflight"
    assert said["failed"] == [
        {"rank": 1, "node": "node-1", "reasons": ["GEMM at 0.40x the median rank's"]}
    ]
    assert "rank 1 (node-1): GEMM at 0.40x the median rank's" in render(report, "md")
    assert "id='preflight'" in render(report, "html")


def test_a_node_whose_ranks_are_slow_together_fails_them() -> None:
    # node b: one GPU far off (0.70x, failed on its own) and one marginal (0.95x, not):
    # the node's median is 0.82x the median node's, so the marginal one fails with it.
    ranks = {
        0: measured(gemm=1.0e11),
        1: measured(gemm=1.0e11),
        2: measured(gemm=0.7e11),
        3: measured(gemm=0.95e11),
        4: measured(gemm=1.0e11),
        5: measured(gemm=1.0e11),
    }
    nodes: dict[int, str | None] = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    got = judge(ranks, nodes)
    assert [r["failed"] for r in got.values()] == [False, False, True, True, False, False]
    assert got[3]["reasons"] == ["node b: GEMM at 0.82x the median node's"]
    assert got[2]["reasons"] == [
        "GEMM at 0.70x the median rank's",
        "node b: GEMM at 0.82x the median node's",
    ]
    assert [r["failed"] for r in judge(ranks).values()].count(True) == 1  # without the nodes
    one_each: dict[int, str | None] = {r: f"n{r}" for r in ranks}
    assert [r["failed"] for r in judge(ranks, one_each).values()].count(True) == 1
