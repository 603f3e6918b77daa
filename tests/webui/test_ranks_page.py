"""The ranks page: its figures as pure functions of query results, its URL, and what it
draws from a real database (SQLite and PostgreSQL) for a straggler, one rank, an empty
run and a missing one."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from plotly.io.json import to_json_plotly
from sqlalchemy import create_engine

from trainwarden.collector.app import create_app
from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.read.schemas import GpuSample, Heatmap, RankInfo
from trainwarden.collector.rollups.worker import flush
from trainwarden.webui.app import create_dash
from trainwarden.webui.client import LocalClient
from trainwarden.webui.components import is_default_pick, parse_user
from trainwarden.webui.pages.ranks import data as ranks_data
from trainwarden.webui.pages.ranks import figures as rf
from trainwarden.webui.pages.ranks import panels as rp
from trainwarden.webui.pages.ranks import query as ranks_query

from ..collector.helpers import batch, step
from .dash_call import dash_call
from .helpers import text


def heatmap(values: list[list[float | None]], metric: str = "step_time") -> Heatmap:
    return Heatmap(
        run="r",
        metric=metric,
        unit="s",
        ranks=list(range(len(values))),
        step_start=[i * 10 for i in range(len(values[0]) if values else 0)],
        bucket=10,
        values=values,
    )


def rank(n: int, state: str = "healthy", **over: Any) -> RankInfo:
    base: dict[str, Any] = dict(
        rank=n,
        local_rank=n,
        host=f"host{n // 8}",
        node=f"node{n // 8}",
        pid=100 + n,
        session="s",
        state=state,
        first_seen=0.0,
        last_seen=1.0,
        last_step=10,
    )
    return RankInfo(**{**base, **over})


# -- figures -----------------------------------------------------------------------


def test_a_straggler_is_the_stripe_and_is_named() -> None:
    grid = rf.grid_of(
        heatmap([[0.1, 0.1, 0.1], [0.1, 0.11, 0.1], [0.3, 0.31, 0.3], [0.1, 0.1, 0.09]])
    )
    found = rf.stripes(grid)
    assert [r for r, _ in found] == [2]
    assert found[0][1] == pytest.approx(3.0, rel=0.05)
    fig = rf.heatmap_figure(grid, title="Step time", theme="light", revision="r:s", selected=2)
    trace = fig["data"][0]
    assert trace["type"] == "heatmap" and trace["y"] == [0, 1, 2, 3]
    assert max(range(4), key=lambda i: sum(rf.cells(trace["z"])[i])) == 2  # the row drawn hottest
    assert fig["layout"]["uirevision"] == "r:s"  # a live refresh keeps the zoom
    assert len(fig["layout"]["shapes"]) == 1  # the selected rank is outlined


def test_nan_and_infinite_cells_are_gaps_not_errors() -> None:
    grid = rf.grid_of(heatmap([[1.0, math.nan], [math.inf, 2.0]]))
    assert grid.values == [[1.0, None], [None, 2.0]]
    fig = rf.heatmap_figure(grid, title="Loss", theme="dark", revision="r")
    assert fig["data"][0]["z"]["dtype"] == "f4"  # a typed array: the browser copies, not parses
    assert rf.cells(fig["data"][0]["z"]) == [[1.0, None], [None, 2.0]]
    assert "NaN" not in to_json_plotly(fig)  # valid JSON for the browser
    assert fig["layout"]["template"]["layout"]["paper_bgcolor"] == "rgb(17,17,17)"


def test_a_heatmap_of_zeros_is_pale_not_the_middle_of_a_scale() -> None:
    zeros = rf.Grid(
        ranks=[0, 1], x=[0.0, 16.0], width=16, values=[[0.0, None], [0.0, None]], unit="s"
    )
    trace = rf.heatmap_figure(zeros, title="t", theme="light", revision="r")["data"][0]
    assert (trace["zmin"], trace["zmax"]) == (0, 1)
    some = rf.Grid(ranks=[0, 1], x=[0.0], width=16, values=[[0.1], [0.3]], unit="s")
    assert "zmin" not in rf.heatmap_figure(some, title="t", theme="light", revision="r")["data"][0]


def test_the_margins_are_fixed_and_fit_the_widest_rank_number() -> None:
    """Plotly is not asked to measure the labels (a second draw): the left margin is made
    for the rank numbers' width, so a 5-digit rank is not cut off; a date axis, whose
    labels take two lines, keeps its automatic margin below."""

    def layout(ranks: list[int], x_title: str = "step") -> dict[str, Any]:
        grid = rf.Grid(ranks=ranks, x=[0.0], width=16, values=[[1.0]] * len(ranks), unit="s")
        fig = rf.heatmap_figure(grid, title="t", theme="light", revision="r", x_title=x_title)
        return fig["layout"]

    small, large = layout([0, 7]), layout([0, 16_383])
    assert small["yaxis"]["automargin"] is False and small["xaxis"]["automargin"] is False
    assert large["margin"]["l"] >= small["margin"]["l"] + 4 * 7  # four more digits
    assert layout([3, 9], x_title="time")["xaxis"]["automargin"] is True


def test_empty_heatmap_says_what_to_wait_for() -> None:
    for grid in (rf.grid_of(heatmap([])), rf.grid_of(heatmap([[None, None]]))):
        fig = rf.heatmap_figure(
            grid, title="Step time", theme=None, revision="r", empty="No steps yet"
        )
        assert fig["data"] == []
        assert fig["layout"]["annotations"][0]["text"] == "No steps yet"


def test_loss_deviation_is_centred_on_the_median_rank_of_each_bucket() -> None:
    grid = rf.deviation(rf.grid_of(heatmap([[4.0, 2.0], [4.1, 2.1], [5.0, None]])))
    assert grid.values[0] == pytest.approx([0.0 - 0.1, -0.05])
    assert grid.values[2][0] == pytest.approx(0.9) and grid.values[2][1] is None
    fig = rf.heatmap_figure(grid, title="Loss", theme=None, revision="r", diverging=True)
    assert fig["data"][0]["zmid"] == 0


def test_one_rank_has_no_stripe() -> None:
    grid = rf.grid_of(heatmap([[0.5, 0.6]]))
    assert rf.stripes(grid) == []
    assert rf.deviation(grid).values == [[0.0, 0.0]]


def test_gpu_temperature_grid_keeps_the_hottest_reading_per_bucket() -> None:
    samples = [
        GpuSample(rank=r, ts=1000.0 + t, temp_c=92.0 if (r, t) == (1, 30) else 45.0)
        for r in range(3)
        for t in range(0, 60, 5)
    ]
    samples.append(GpuSample(rank=0, ts=1001.0, temp_c=math.nan))
    grid = rf.gpu_grid(samples, buckets=6)
    assert grid.ranks == [0, 1, 2] and grid.unit == "°C"
    hottest = max((v, r) for r, row in zip(grid.ranks, grid.values, strict=True) for v in row if v)
    assert hottest == (92.0, 1)
    assert rf.gpu_grid([]).ranks == []


def test_gpu_temperature_buckets_are_never_narrower_than_the_sampling_interval() -> None:
    """A short run sampled every 5 s: 120 buckets of 1 s would leave four cells in five
    empty. Each rank's row is full, and a hot reading still shows in its own bucket."""
    samples = [
        GpuSample(rank=r, ts=1000.0 + t + 0.3 * r, temp_c=90.0 if (r, t) == (0, 40) else 45.0)
        for r in range(2)
        for t in range(0, 60, 5)
    ]
    grid = rf.gpu_grid(samples)
    assert grid.width == pytest.approx(5.0)
    assert all(v is not None for row in grid.values for v in row), grid.values
    assert max(grid.values[0]) == 90.0 and max(grid.values[1]) == 45.0
    # A long run: the 120 buckets are wider than the interval and stay as they were.
    long = [GpuSample(rank=0, ts=1000.0 + t, temp_c=45.0) for t in range(0, 3600, 5)]
    assert rf.gpu_grid(long).width == pytest.approx(3595 / 120)


def test_states_table_counts_states_and_lists_the_unhealthy_first() -> None:
    ranks = [
        rank(0),
        rank(1, "slow", state_detail={"role": "culprit", "reason": "compute 3x"}),
        rank(2, "dead"),
        rank(3, "evicted"),
        rank(4, "hung"),
    ]
    table = rp.states_table("r", ranks, selected=1)
    shown = text(table)
    assert "1 dead" in shown and "1 slow" in shown and "1 healthy" in shown
    assert shown.index("1 dead") < shown.index("1 hung") < shown.index("1 slow")
    assert "culprit: compute 3x" in shown
    row = next(c for c in ranks_walk(table) if getattr(c, "id", None) == "ranks-row-1")
    assert "rank-selected" in row.className
    assert rp.rank_href("my run", 3, "from=1&to=2") == "/runs/my%20run/ranks?from=1&to=2&rank=3"


def test_a_big_run_lists_only_its_unhealthy_ranks() -> None:
    ranks = [rank(i) for i in range(200)] + [rank(200, "hung")]
    shown = text(rp.states_table("r", ranks, selected=None))
    assert "200 ranks not listed" in shown and "200 healthy" in shown
    assert (
        len(
            [
                c
                for c in ranks_walk(rp.states_table("r", ranks, selected=None))
                if str(getattr(c, "id", "")).startswith("ranks-row-")
            ]
        )
        == 1
    )


def test_a_big_finished_run_lists_at_most_a_screenful_of_ranks() -> None:
    # 1,024 finished ranks and 100 slow ones: not a table of a thousand rows (it takes the
    # browser minutes to draw), the slow first and at most RANK_ROWS of them.
    ranks = [rank(i, "finished") for i in range(1024)] + [
        rank(1024 + i, "slow") for i in range(100)
    ]
    rows = [
        c
        for c in ranks_walk(rp.states_table("r", ranks, selected=None))
        if str(getattr(c, "id", "")).startswith("ranks-row-")
    ]
    assert len(rows) == rp.RANK_ROWS and rows[0].id == "ranks-row-1024"
    assert f"{1124 - rp.RANK_ROWS} ranks not listed" in text(
        rp.states_table("r", ranks, selected=None)
    )


def ranks_walk(component: Any) -> Iterator[Any]:
    from .helpers import walk

    return walk(component)


# -- the URL -------------------------------------------------------------------------


def test_query_string_round_trip_and_bad_input() -> None:
    assert ranks_query.parse_query("?rank=3&from=100&to=200") == (3, 100, 200)
    assert ranks_query.parse_query("?rank=abc&from=9&to=2") == (None, 2, 9)
    assert ranks_query.parse_query(None) == (None, None, None)
    assert ranks_query.query_string(3, None, 50) == "?rank=3&to=50"
    assert ranks_query.query_string(None, None, None) == ""
    assert ranks_query.query_string(2, None, None, user="user.moe.load") == "?rank=2&user=moe.load"
    assert parse_user("?rank=2&user=moe.load") == "user.moe.load"
    assert parse_user("?user=") is None and parse_user(None) is None
    assert ranks_query.range_from_relayout({"xaxis.range[0]": 10.4, "xaxis.range[1]": 19.6}) == (
        10,
        20,
    )
    assert ranks_query.range_from_relayout({"xaxis.autorange": True}) == (None, None)
    assert ranks_query.range_from_relayout({"yaxis.range[0]": 1, "yaxis.range[1]": 2}) is None
    assert ranks_query.clicked_rank({"points": [{"x": 20, "y": 2}]}) == 2
    assert ranks_query.clicked_rank({}) is None


def test_the_user_metric_pick_goes_to_the_url_whatever_the_heatmap_does() -> None:
    """A pick redraws the user heatmap, whose relayout comes while the pick's call is in
    flight: Dash drops the answer of a callback called again meanwhile (under dash 4.4.1
    the pick never reached the address). The pick has a callback of its own."""
    app = create_dash(LocalClient(create_engine("sqlite://")))
    options = [{"label": m, "value": f"user.{m}"} for m in ("eval.acc", "moe.load")]
    values = {
        "ranks-user-metric.value": "user.moe.load",
        "ranks-user-metric.options": options,
        "ranks-user.relayoutData": {"autosize": True},
        "ranks-url.search": "?rank=2",
    }
    pick = dash_call(app, "ranks-url.search", values, ["ranks-user-metric.value"])
    assert pick == {"ranks-url": {"search": "?rank=2&user=moe.load"}}
    picker = [
        cb
        for key, cb in app.callback_map.items()
        if {"id": "ranks-user-metric", "property": "value"} in cb["inputs"]
        and key.startswith("ranks-url.search")
    ]
    assert [i["id"] for cb in picker for i in cb["inputs"]] == ["ranks-user-metric"]
    # A refresh that sets the default metric writes nothing.
    default = {**values, "ranks-user-metric.value": "user.eval.acc"}
    assert dash_call(app, "ranks-url.search", default, ["ranks-user-metric.value"]) == {}


def test_a_gesture_not_applied_yet_is_applied_by_a_newer_call() -> None:
    """Clicks and zooms reach follow numbered, through stores (their clientside callbacks
    keep a refresh's redraw out: the browser tests). Dash drops the answer of a call when
    the same callback is called again meanwhile: the newer call applies every gesture
    numbered above the one last applied, oldest first, on both stores."""
    app = create_dash(LocalClient(create_engine("sqlite://")))
    heat = {"list": [{"n": 1, "rank": 3}]}
    user = {"list": [{"n": 2, "relayout": {"xaxis.range[0]": 0, "xaxis.range[1]": 9}}]}
    values = {
        "ranks-gestures.data": heat,
        "ranks-user-gestures.data": user,
        "ranks-url.search": "?user=moe.load",
    }
    for changed in (["ranks-gestures.data"], ["ranks-user-gestures.data"]):
        found = dash_call(app, "ranks-url.search", values, changed)
        assert found == {
            "ranks-url": {"search": "?rank=3&from=0&to=10&user=moe.load"},
            "ranks-gesture-applied": {"data": 2},
        }, changed
    # The click's answer came (applied 1): the zoom alone, on the URL the click made.
    after = {**values, "ranks-gesture-applied.data": 1, "ranks-url.search": "?rank=1"}
    found = dash_call(app, "ranks-url.search", after, ["ranks-user-gestures.data"])
    assert found == {
        "ranks-url": {"search": "?rank=1&from=0&to=10"},
        "ranks-gesture-applied": {"data": 2},
    }
    # Nothing new: nothing written.
    done = {**values, "ranks-gesture-applied.data": 2}
    assert dash_call(app, "ranks-url.search", done, ["ranks-gestures.data"]) == {}
    # A double-click (autorange) drops the range; the newest gesture wins.
    reset = {"list": [*heat["list"], {"n": 3, "relayout": {"xaxis.autorange": True}}]}
    found = dash_call(
        app,
        "ranks-url.search",
        {
            **values,
            "ranks-gestures.data": reset,
            "ranks-gesture-applied.data": 2,
            "ranks-url.search": "?rank=3&from=0&to=10&user=moe.load",
        },
        ["ranks-gestures.data"],
    )
    assert found == {
        "ranks-url": {"search": "?rank=3&user=moe.load"},
        "ranks-gesture-applied": {"data": 3},
    }
    assert ranks_query.apply_gestures("?rank=2", [None, {"list": [{"n": 5}]}], 4) == ("?rank=2", 5)


# -- through a real database -----------------------------------------------------------


@pytest.fixture
def api(engine):  # type: ignore[no-untyped-def]
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as c:
        yield c


def ingest(api: TestClient, body: dict[str, Any]) -> None:
    response = api.post("/api/v1/ingest", json=body)
    assert response.status_code == 200, response.text
    flush(api.app.state.engine, now=time.time(), grace_s=0)  # type: ignore[attr-defined]


def test_page_names_the_straggler_and_shows_a_rank_detail(api: TestClient, engine: Any) -> None:
    for r in range(4):
        ingest(
            api,
            batch(
                "r1",
                rank=r,
                world_size=4,
                steps=[
                    step(i, duration=0.3 if r == 2 else 0.1, loss=2.0 + r / 100) for i in range(40)
                ],
            ),
        )
    client = LocalClient(engine)
    fig = ranks_data.heatmap_part(client, "r1", "step_time", "", "light")
    assert "stands out: rank 2 (3.0× its peers)" in fig["layout"]["title"]["text"]
    loss = ranks_data.heatmap_part(client, "r1", "loss_dev", "?from=10&to=19", "light")
    z = rf.cells(loss["data"][0]["z"])
    assert len(z[0]) == 10 and z[3][0] > 0
    note, states, detail = ranks_data.states_part(client, "r1", "?rank=2", "light")
    assert note is None
    rows = [c for c in ranks_walk(states) if str(getattr(c, "id", "")).startswith("ranks-row-")]
    assert len(rows) == 4
    assert "Rank 2" in text(detail)
    _, _, missing = ranks_data.states_part(client, "r1", "?rank=9", "light")
    assert "Rank 9 has not reported in run 'r1' (ranks 0–3)" in text(missing)


def test_a_user_metric_heatmap_names_the_rank_that_stands_out(api: TestClient, engine: Any) -> None:
    ingest(api, batch("plain", rank=0, world_size=1, steps=[step(0)]))
    client = LocalClient(engine)
    assert ranks_data.user_choices(client, "plain", "") == ([], None)
    empty = ranks_data.user_heatmap_part(client, "plain", None, "", "light")
    assert "s.metric(name, value)" in empty.layout.annotations[0].text

    for r in range(4):  # rank 3's router sends it 2x the tokens; "delta" goes negative
        steps = [
            {**step(i), "metrics": {"moe.load": 2.0 if r == 3 else 1.0, "delta": -1.0 - r}}
            for i in range(20)
        ]
        ingest(api, batch("moe", rank=r, world_size=4, steps=steps))
    options, value = ranks_data.user_choices(client, "moe", "?rank=3")
    assert [o["label"] for o in options] == ["delta", "moe.load"]
    assert value == "user.delta"  # no pick in the URL: the first, which the URL does not get
    assert is_default_pick(value, options, None) and not is_default_pick(
        value, options, "user.delta"
    )
    assert not is_default_pick("user.moe.load", options, None)
    first = ranks_data.user_heatmap_part(client, "moe", None, "", "light")
    assert first["layout"]["title"]["text"].startswith("User metric delta")
    assert ranks_data.user_choices(client, "moe", "?user=moe.load")[1] == "user.moe.load"
    assert ranks_data.user_choices(client, "moe", "?user=gone")[1] == "user.delta"
    fig = ranks_data.user_heatmap_part(client, "moe", "user.moe.load", "?rank=3", "light")
    assert fig["layout"]["title"]["text"] == (
        "User metric moe.load (max per cell) · stands out: rank 3 (2.0× its peers)"
    )
    z = rf.cells(fig["data"][0]["z"])
    assert [row[0] for row in z] == [1.0, 1.0, 1.0, 2.0]
    delta = ranks_data.user_heatmap_part(client, "moe", "user.delta", "?from=5&to=9", "light")
    assert "stands out" not in delta["layout"]["title"]["text"]  # no ratios below zero
    assert len(rf.cells(delta["data"][0]["z"])[0]) == 5


def test_one_rank_and_a_missing_run(api: TestClient, engine: Any) -> None:
    ingest(api, batch("solo", rank=0, world_size=1, steps=[step(i) for i in range(5)]))
    client = LocalClient(engine)
    note, _, _ = ranks_data.states_part(client, "solo", "", None)
    assert "one rank" in text(note)
    fig = ranks_data.heatmap_part(client, "solo", "loss_dev", "", None)
    assert "One rank" in fig.layout.annotations[0].text
    with pytest.raises(NotFound):
        ranks_data.heatmap_part(client, "nope", "step_time", "", None)
