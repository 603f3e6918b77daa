"""The hardware page: GPU table, XID table and graphs as pure functions of GPU readings
and events, and the page's parts from a real database (SQLite and PostgreSQL)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from trainwarden.agent.gpu import describe_xid
from trainwarden.collector.app import create_app
from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.read.schemas import EventOut, GpuSample, RankInfo
from trainwarden.webui.client import LocalClient
from trainwarden.webui.pages.hardware import data as hardware_data
from trainwarden.webui.pages.hardware import figures as hw_figures
from trainwarden.webui.pages.hardware import panels as hf

from ..collector.helpers import batch, step
from .helpers import text, walk

NOW = 1_700_000_000.0


def sample(rank: int, ts: float = NOW, **over: Any) -> GpuSample:
    base: dict[str, Any] = dict(
        rank=rank,
        ts=ts,
        gpu_uuid=f"GPU-{rank}",
        gpu_name="NVIDIA H100",
        temp_c=50.0,
        power_w=300.0,
        power_limit_w=700.0,
        sm_clock_mhz=1980.0,
        sm_clock_max_mhz=1980.0,
        throttle=[],
        ecc_corrected=0,
        ecc_uncorrected=0,
    )
    return GpuSample(**{**base, **over})


def rank(n: int, node: str = "node0", **over: Any) -> RankInfo:
    base: dict[str, Any] = dict(
        rank=n,
        local_rank=n,
        host=node,
        node=node,
        pid=1,
        session="s",
        state="healthy",
        first_seen=0.0,
        last_seen=1.0,
        last_step=3,
    )
    return RankInfo(**{**base, **over})


def xid(code: int, rank: int = 1, **data: Any) -> EventOut:
    return EventOut(
        id=code,
        kind="xid",
        severity="critical",
        ts=NOW,
        recv_ts=NOW,
        rank=rank,
        step=40,
        data={"code": code, **data},
    )


def row(table: Any, n: int) -> Any:
    return next(c for c in walk(table) if getattr(c, "id", None) == f"hw-gpu-{n}")


def test_gpu_table_groups_by_node_and_marks_the_hot_throttled_gpu() -> None:
    samples = [
        sample(0, NOW - 10, temp_c=60.0),
        sample(0, temp_c=92.0, throttle=["sw_thermal"]),
        sample(1),
        sample(2, ecc_uncorrected=3),
    ]
    ranks = [
        rank(0),
        rank(1),
        rank(2, "node1"),
        rank(3, "node1", gpu={"state": "unavailable", "reason": "NVML unavailable"}),
    ]
    table = hf.gpu_table("r", samples, ranks)
    shown = text(table)
    assert "node0 · 2 GPUs · hottest 92 °C" in shown and "node1 · 2 GPUs" in shown
    assert "hot (92 °C); throttled: sw_thermal" in text(row(table, 0))  # the newest reading
    assert row(table, 0).className == "gpu-bad" and row(table, 1).className is None
    assert "3 uncorrectable ECC errors" in text(row(table, 2))
    assert "no GPU telemetry: NVML unavailable" in text(row(table, 3))
    throttle = next(c for c in walk(row(table, 0)) if getattr(c, "title", None))
    assert throttle.title == hf.THROTTLE_HELP["sw_thermal"]
    only = hf.gpu_table("r", samples, ranks, selected=2)
    assert [c.id for c in walk(only) if str(getattr(c, "id", "")).startswith("hw-gpu-")] == [
        "hw-gpu-2"
    ]


def test_a_big_run_lists_only_the_gpus_with_a_problem() -> None:
    samples = [sample(i) for i in range(100)] + [sample(100, temp_c=95.0)]
    table = hf.gpu_table("r", samples, [])
    ids = [c.id for c in walk(table) if str(getattr(c, "id", "")).startswith("hw-gpu-")]
    assert ids == ["hw-gpu-100"] and "100 GPUs with nothing wrong" in text(table)


def test_a_gpu_with_an_xid_that_calls_for_action_is_a_problem_even_with_fine_readings() -> None:
    # Rank 1's readings are fine; its GPU reported XID 63 (reset the GPU) and 45 (nothing
    # to do). Rank 2's GPU fell off the bus (XID 79) and sent no reading after it.
    xids = hf.xid_rows([xid(63, rank=1), xid(45, rank=1), xid(79, rank=2)], [])
    table = hf.gpu_table("r", [sample(0), sample(1)], [rank(0), rank(1), rank(2)], xids=xids)
    when = time.strftime("%H:%M:%S", time.localtime(NOW))
    assert row(table, 1).className == "gpu-bad" and row(table, 0).className is None
    assert f"XID 63 at {when}: reset the GPU" in text(row(table, 1))
    assert "XID 45" not in text(table)
    assert row(table, 2).className == "gpu-bad"
    assert f"no GPU telemetry; XID 79 at {when}: drain the node" in text(row(table, 2))
    # In a big run, where only GPUs with a problem are listed, both are.
    samples = [sample(i) for i in range(100)]
    big = hf.gpu_table("r", samples, [], xids=hf.xid_rows([xid(63, rank=7), xid(79, rank=120)], []))
    ids = [c.id for c in walk(big) if str(getattr(c, "id", "")).startswith("hw-gpu-")]
    assert ids == ["hw-gpu-7", "hw-gpu-120"], ids


def test_xid_rows_carry_the_catalog_meaning() -> None:
    full = xid(79, name="GPU has fallen off the bus", meaning="gone", action="reboot_node")
    bare = xid(48, rank=0)  # an older agent sent only the code
    rows = hf.xid_rows([bare, full], [rank(0), rank(1, "node7")])
    assert {r.code for r in rows} == {79, 48}
    by_code = {r.code: r for r in rows}
    assert by_code[48].meaning == describe_xid(48)["meaning"] and by_code[48].node == "node0"
    assert by_code[79].node == "node7" and by_code[79].action == "reboot_node"
    shown = text(hf.xid_table(rows))
    assert "XID 48" in shown and describe_xid(48)["meaning"] in shown and "reboot the node" in shown
    assert "No XID errors" in text(hf.xid_table([]))
    unknown = hf.xid_rows([xid(9999)], [])[0]
    assert "Not in trainwarden's catalog" in unknown.meaning


def test_gpu_figure_lines_nan_and_empty() -> None:
    samples = [
        sample(r, NOW + t, temp_c=math.nan if t == 5 else 50.0 + r)
        for r in range(3)
        for t in range(0, 30, 5)
    ]
    fig = hw_figures.gpu_figure(samples, "temp", theme="dark", revision="r")
    assert [t.name for t in fig.data] == ["rank 0", "rank 1", "rank 2"]
    assert all(len(t.y) == 5 for t in fig.data)  # the NaN reading is left out
    assert hw_figures.gpu_figure([], "power", theme=None, revision="r").data == ()


def test_gpu_figure_of_many_gpus_is_a_band_and_the_worst() -> None:
    samples = [
        sample(r, NOW + t, temp_c=90.0 if r == 7 else 50.0) for r in range(40) for t in (0, 5)
    ]
    fig = hw_figures.gpu_figure(samples, "temp", theme=None, revision="r")
    names = [t.name for t in fig.data]
    assert "min..max across GPUs" in names and "median" in names
    assert names[3] == "rank 7"  # the hottest GPU is drawn on its own
    assert len(names) == 6


@pytest.fixture
def api(engine):  # type: ignore[no-untyped-def]
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as c:
        yield c


def test_page_parts_from_the_database(api: TestClient, engine: Any) -> None:
    now = time.time()
    body = batch(
        "hw",
        rank=1,
        world_size=2,
        steps=[step(1)],
        events=[
            {"id": "x1", "kind": "xid", "ts": now, "severity": "critical", "data": {"code": 79}}
        ],
    )
    assert api.post("/api/v1/ingest", json=body).status_code == 200
    client = LocalClient(engine)
    note, table, xids, *graphs = hardware_data.page_parts(client, "hw", "", "light")
    assert "No GPU readings for this run yet" in text(note)
    assert describe_xid(79)["meaning"] in text(xids)
    assert len(graphs) == 3 and all(g.data == () for g in graphs)
    narrowed = hardware_data.page_parts(client, "hw", "?rank=0", "light")
    assert "rank 0's GPU only" in text(narrowed[0]) and "No XID errors" in text(narrowed[2])
    with pytest.raises(NotFound):
        hardware_data.page_parts(client, "nope", "", None)
