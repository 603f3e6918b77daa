"""The run overview: its figure (a pure function), the view in the URL, and a range
selected on the figure."""

from __future__ import annotations

import datetime as dt
import json
import math

import plotly.graph_objects as go
import pytest

from trainwarden.collector.read.schemas import EventOut, ReplacedSeries, Series
from trainwarden.webui.pages.overview import data as overview_data
from trainwarden.webui.pages.overview import figures as overview_figures
from trainwarden.webui.pages.overview import panels as overview_panels
from trainwarden.webui.pages.overview import query as overview_query
from trainwarden.webui.pages.overview.figures import ROW_EMPTY, Marker, Overview, RankLine
from trainwarden.webui.pages.overview.traces import thin

T0 = 1_700_000_000.0


def overview_figure(data: Overview, **kwargs: object) -> go.Figure:
    """The figure (Plotly's JSON, as the page sends it), read back through ``go.Figure``:
    which also checks that every property is one Plotly knows."""
    return go.Figure(overview_figures.overview_figure(data, **kwargs))  # type: ignore[arg-type]


def series(metric: str, steps: int = 10, *, n: int = 4, value: float = 1.0, **cols: list) -> Series:
    xs = list(range(steps))
    base = {
        "min": [value * 0.5] * steps,
        "median": [value] * steps,
        "max": [value * 2] * steps,
        "total": [value] * steps,
        "argmax_rank": [1] * steps,
    }
    base.update(cols)
    return Series(
        run="r", metric=metric, unit="", step=xs, ts=[T0 + x for x in xs], n=[n] * steps, **base
    )


PARTS = {
    "step_time": 1.0,
    "compute": 0.6,
    "overlapped_comm": 0.2,
    "exposed_comm": 0.1,
    "data_wait": 0.05,
}


def full(steps: int = 10, *, n: int = 4) -> dict[str, Series]:
    return {m: series(m, steps, n=n, value=PARTS.get(m, 1.0)) for m in overview_data.METRICS}


def traces(fig, row: int) -> list:  # type: ignore[no-untyped-def]
    axis = "y" if row == 1 else f"y{row}"
    return [t for t in fig.data if t.yaxis == axis and t.name]  # not the rows' placeholders


def test_one_figure_with_every_row_on_one_shared_x_axis() -> None:
    fig = overview_figure(Overview(series=full()), revision="r|step")
    titles = [a.text for a in fig.layout.annotations]
    for title in ("Throughput", "MFU", "Loss", "Grad norm", "Step time breakdown"):
        assert any(t.startswith(title) for t in titles), title
    # Every row follows the bottom row's x-axis: a zoom on one zooms them all.
    assert {fig.layout["xaxis" + (str(i) if i > 1 else "")].matches for i in range(1, 6)} == {"x6"}
    assert [t.name for t in traces(fig, 4)] == ["loss max", "loss min..max", "loss median"]
    assert traces(fig, 4)[1].fill == "tonexty"
    assert list(traces(fig, 2)[0].y) == [1.0] * 10  # the job's tokens/s
    stacked = [t.name for t in traces(fig, 6) if t.stackgroup]
    assert stacked == [
        "compute",
        "overlapped comm",
        "exposed comm",
        "other (idle, slowest rank)",
        "data wait",
    ]
    assert all(t.stackgroup == "time" for t in traces(fig, 6)[: len(stacked)])
    assert fig.layout.uirevision == "r|step"  # live refresh keeps hidden traces and zoom
    assert fig.layout.yaxis4.fixedrange  # a drag selects steps, not values
    assert fig.layout.xaxis6.title.text == "step"
    # Fixed margins: Plotly draws once, without measuring every tick label for them.
    assert not fig.layout.yaxis4.automargin and not fig.layout.xaxis6.automargin


def test_breakdown_other_is_what_the_slowest_rank_holds_beyond_compute_and_exposed_comm() -> None:
    fig = overview_figure(Overview(series=full(3)))
    layers = {t.name: list(t.y) for t in traces(fig, 6)}
    assert [round(v, 6) for v in layers["compute"]] == [0.4] * 3
    assert layers["overlapped comm"] == [0.2] * 3
    assert [round(v, 6) for v in layers["other (idle, slowest rank)"]] == [0.3] * 3


def test_step_time_median_and_p99_across_ranks_are_lines_over_the_stack() -> None:
    parts = full(4)
    parts["step_time"] = series(
        "step_time", 4, value=1.0, p99=[1.1, 1.2, float("nan"), 1.9], median=[0.9, 1.0, 1.0, 1.0]
    )
    fig = overview_figure(Overview(series=parts))
    lines = {t.name: t for t in traces(fig, 6) if not t.stackgroup}
    assert set(lines) == {"step time p99 across ranks", "step time median across ranks"}
    assert list(lines["step time p99 across ranks"].y) == [1.1, 1.2, None, 1.9]  # NaN: a gap
    assert list(lines["step time median across ranks"].y) == [0.9, 1.0, 1.0, 1.0]
    assert lines["step time p99 across ranks"].line.dash == "dash"
    # A collector from before p99 (no p99 column): the median alone, no error.
    parts["step_time"] = series("step_time", 4, value=1.0)
    fig = overview_figure(Overview(series=parts))
    assert [t.name for t in traces(fig, 6) if not t.stackgroup] == ["step time median across ranks"]


def test_without_a_comm_split_the_breakdown_is_the_step_time() -> None:
    parts = full(3)
    for metric in ("compute", "exposed_comm", "overlapped_comm"):
        parts[metric] = series(metric, 0)
    fig = overview_figure(Overview(series=parts))
    stacked = [t.name for t in traces(fig, 6) if t.stackgroup]
    assert stacked == ["step time (no comm split reported)", "data wait"]


def test_markers_say_what_they_are_and_alerts_draw_a_line_across_the_rows() -> None:
    markers = [
        Marker("alert", T0 + 3, 3, "alert LossSpike rank 1 (critical, firing)", "bad"),
        Marker("checkpoint", T0 + 2, 2, "checkpoint at step 2: good", "good"),
        Marker("checkpoint", T0 + 6, 6, "checkpoint at step 6: suspect, saved before ...", "warn"),
        Marker("action", T0 + 7, 7, "action rollback done", "good"),
        Marker("restart", T0 + 8, 8, "rank 0 restarted", "info"),
        Marker("action", T0 + 9, None, "no step: left out on the step axis", "bad"),
    ]
    fig = overview_figure(Overview(series=full(), markers=markers))
    shown = {t.name: (list(t.x), list(t.text)) for t in traces(fig, 1)}
    assert shown["alert"] == ([3], ["alert LossSpike rank 1 (critical, firing)"])
    assert [x for name, (xs, _) in shown.items() if name == "checkpoint" for x in xs] != []
    checkpoints = [t for t in traces(fig, 1) if t.name == "checkpoint"]
    assert {t.marker.symbol for t in checkpoints} == {"square", "square-open"}  # good vs suspect
    assert shown["restart"] == ([8], ["rank 0 restarted"])
    assert sum(len(t.x) for t in traces(fig, 1)) == 5
    lines = [s for s in fig.layout.shapes if s.yref == "paper"]
    assert sorted(s.x0 for s in lines) == [3, 8]  # the alert and the restart


def test_time_axis_places_everything_at_its_time() -> None:
    markers = [Marker("action", T0 + 9, None, "action stop done", "good")]
    fig = overview_figure(Overview(series=full(), markers=markers), axis="time")
    assert fig.layout.xaxis6.title.text == "time"
    assert fig.layout.xaxis6.automargin  # a date's labels take two lines: room made below
    assert traces(fig, 2)[0].x[0] == dt.datetime.fromtimestamp(T0)
    assert list(traces(fig, 1)[0].x) == [dt.datetime.fromtimestamp(T0 + 9)]


def test_spikes_and_outlier_ranks_on_the_loss_row() -> None:
    data = Overview(
        series=full(),
        spikes=[
            (4, 2, "loss_spike", 9.0),
            (5, 3, "nonfinite_loss", None),
            (6, 1, "grad_norm_spike", 40.0),
        ],
        ranks=[RankLine(2, "1 loss spike", [0, 1, 4], [T0, T0 + 1, T0 + 4], [1.0, 1.1, 9.0])],
    )
    fig = overview_figure(data)
    loss = {t.name: t for t in traces(fig, 4)}
    assert list(loss["loss spike"].x) == [4, 5]
    assert list(loss["loss spike"].y) == [9.0, 2.0]  # a NaN loss is marked at the row's top
    assert "rank 3: nonfinite loss" in loss["loss spike"].text[1]
    assert list(loss["rank 2"].y) == [1.0, 1.1, 9.0]
    grad = {t.name: t for t in traces(fig, 5)}
    assert list(grad["grad-norm spike"].x) == [6]


def test_steps_a_rollback_ran_again_keep_their_earlier_execution_in_sight() -> None:
    # Steps 4-6 were run again after a rollback: their first execution spiked to 300.
    loss = ReplacedSeries(
        run="r",
        metric="loss",
        unit="",
        step=[4, 5, 6],
        ts=[T0 + 4, T0 + 5, T0 + 6],
        n=[4, 4, 4],
        min=[250.0, 100.0, 20.0],
        mean=[280.0, 150.0, 30.0],
        max=[300.0, 200.0, 40.0],
    )
    fig = overview_figure(Overview(series=full(), replaced={"loss": loss}))
    replaced = {t.name: t for t in traces(fig, 4)}["replaced (run again)"]
    assert (list(replaced.x), list(replaced.y)) == ([4, 5, 6], [300.0, 200.0, 40.0])
    assert replaced.line.dash == "dot" and replaced.showlegend
    assert "loss before it was run again" in replaced.hovertemplate
    assert "replaced (run again)" not in {t.name for t in traces(fig, 5)}  # no grad norm ones
    on_time = overview_figure(Overview(series=full(), replaced={"loss": loss}), axis="time")
    assert {t.name: t for t in traces(on_time, 4)}["replaced (run again)"].x[
        0
    ] == dt.datetime.fromtimestamp(T0 + 4)
    # The loss as it is now (0.5..2 across ranks) keeps the row: the 300 runs off its top,
    # and a note gives the peak. The grad norm row, with nothing replaced, scales itself.
    assert list(fig.layout.yaxis4.range) == pytest.approx([0.35, 2.15])
    notes = [a.text for a in fig.layout.annotations if a.yref == "y4 domain"]
    assert notes == ["replaced (run again): peak 300, above this scale"]
    assert fig.layout.yaxis5.range is None
    # A replaced execution within reach of the live values: one scale for all, no note.
    near = ReplacedSeries(
        run="r",
        metric="loss",
        unit="",
        step=[4],
        ts=[T0 + 4],
        n=[4],
        min=[2.5],
        mean=[3.0],
        max=[3.5],
    )
    fig = overview_figure(Overview(series=full(), replaced={"loss": near}))
    assert fig.layout.yaxis4.range is None
    assert not [a for a in fig.layout.annotations if a.yref == "y4 domain"]


def test_outlier_ranks_are_the_url_rank_then_spiky_ranks_then_a_usual_maximum() -> None:
    loss = series("loss", 10, n=8, argmax_rank=[5] * 8 + [1, 2])
    spikes = [
        (1, 3, "loss_spike", 2.0),
        (2, 3, "loss_spike", 2.0),
        (4, 6, "nonfinite_loss", None),
        (7, 4, "grad_norm_spike", 3.0),
    ]
    picked = overview_data.outlier_ranks(loss, spikes, wanted=0)
    assert [r for r, _ in picked] == [0, 3, 6]  # at most three
    assert picked[1][1] == "2 loss spikes"
    assert [r for r, _ in overview_data.outlier_ranks(loss, [], wanted=None)] == [5]
    # With two ranks one is always the highest: not an outlier.
    two = series("loss", 10, n=2, argmax_rank=[1] * 10)
    assert overview_data.outlier_ranks(two, [], wanted=None) == []


def test_empty_run_says_so_and_what_happens_next() -> None:
    empty = {m: series(m, 0) for m in overview_data.METRICS}
    fig = overview_figure(Overview(series=empty), theme="dark", revision="r")
    assert fig.data == ()
    assert "No steps yet" in fig.layout.annotations[0].text
    assert fig.layout.template.layout.paper_bgcolor is not None  # the dark template
    zoomed = overview_figure(Overview(series=empty), x_range=(5, 9))
    assert "No steps in this range" in zoomed.layout.annotations[0].text


def test_a_run_with_one_rank_draws_its_line_and_no_outliers() -> None:
    one = full(5, n=1)
    one["loss"] = series("loss", 5, n=1, min=[2.0] * 5, median=[2.0] * 5, max=[2.0] * 5)
    assert overview_data.outlier_ranks(one["loss"], [], wanted=None) == []
    fig = overview_figure(Overview(series=one))
    median = traces(fig, 4)[2]
    assert list(median.y) == [2.0] * 5
    assert all(c[2] == 1 for c in median.customdata)  # hover: 1 rank


def test_nan_and_infinite_values_are_gaps_and_the_figure_serializes() -> None:
    nan, inf = float("nan"), float("inf")
    parts = full(4)
    parts["loss"] = series(
        "loss", 4, min=[1.0, nan, 1.0, 1.0], median=[1.0, nan, inf, 1.0], max=[1.0, nan, 1.0, 1.0]
    )
    parts["mfu"] = series("mfu", 4, total=[nan] * 4)
    fig = overview_figure(Overview(series=parts))
    assert list(traces(fig, 4)[2].y) == [1.0, None, None, 1.0]
    text = fig.to_json()
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text)
    # A row with nothing to draw says what to do instead.
    notes = [a.text for a in fig.layout.annotations]
    assert ROW_EMPTY["mfu"] in notes
    # Its axis numbers nothing; the rows with data keep their tick labels.
    assert fig.layout.yaxis3.showticklabels is False
    assert fig.layout.yaxis4.showticklabels is not False


def test_theme_light_and_dark() -> None:
    light = overview_figure(Overview(series=full()), theme="light")
    dark = overview_figure(Overview(series=full()), theme="dark")
    assert light.layout.template.layout.font.color != dark.layout.template.layout.font.color
    assert dark.layout.paper_bgcolor == "rgba(0,0,0,0)"


def test_a_range_shows_as_it_is_and_zooming_again_is_not_undone() -> None:
    fig = overview_figure(Overview(series=full()), revision="r|step", x_range=(2, 8))
    assert list(fig.layout.xaxis.range) == [2, 8]
    other = overview_figure(Overview(series=full()), revision="r|step", x_range=(3, 5))
    # A new range is a new x revision (applied); the same range keeps the user's zoom.
    assert fig.layout.xaxis.uirevision != other.layout.xaxis.uirevision
    assert (
        fig.layout.xaxis.uirevision
        == overview_figure(
            Overview(series=full()), revision="r|step", x_range=(2, 8)
        ).layout.xaxis.uirevision
    )


def test_thin_keeps_spikes() -> None:
    steps = list(range(10_000))
    values: list[float | None] = [1.0] * 10_000
    values[7_777] = 50.0
    values[123] = -3.0
    xs, ts, ys = thin(steps, [float(s) for s in steps], values, 1_000)
    assert len(xs) <= 1_000
    assert 50.0 in ys and -3.0 in ys
    assert xs == sorted(xs)
    assert thin([1, 2], [1.0, 2.0], [math.nan, 1.0], 1_000) == ([1, 2], [1.0, 2.0], [math.nan, 1.0])


def test_view_round_trips_through_the_query_string() -> None:
    view = overview_query.parse_query("?from=100&to=900&axis=time&rank=3&user=moe.aux")
    assert view == {"from": 100, "to": 900, "axis": "time", "rank": 3, "user": "user.moe.aux"}
    assert overview_query.parse_query(overview_query.to_query(view)) == view
    assert overview_query.to_query(overview_query.parse_query("")) == ""
    # What does not parse is left out; a reversed range is put the right way round.
    assert overview_query.parse_query("?from=x&to=-4&axis=weird&rank=a&user=") == {
        "from": None,
        "to": None,
        "axis": "step",
        "rank": None,
        "user": None,
    }
    assert overview_query.parse_query("?from=900&to=100")["from"] == 100


def test_a_user_metric_draws_its_band_median_and_p99() -> None:
    s = series("user.moe.aux", 5, value=2.0, p99=[3.0, 3.0, float("nan"), 3.0, 3.0])
    fig = go.Figure(overview_figures.user_figure(s, theme="dark", revision="r|step|user.moe.aux"))
    assert [t.name for t in fig.data] == [
        "moe.aux max",
        "moe.aux min..max",
        "moe.aux median",
        "moe.aux p99",
    ]
    assert list(fig.data[2].y) == [2.0] * 5 and list(fig.data[3].y) == [3.0, 3.0, None, 3.0, 3.0]
    assert fig.layout.title.text.startswith("moe.aux: median, p99")
    empty = overview_figures.user_figure(series("user.x", 0), theme="light")
    assert "No values of x" in empty["layout"]["annotations"][0]["text"]


def test_range_from_a_zoom_on_any_row() -> None:
    pick = overview_query.range_from_relayout
    assert pick({"xaxis.range[0]": 10.4, "xaxis.range[1]": 29.6}, axis="step", xmap=None) == (
        10,
        30,
    )
    assert pick({"xaxis3.range[0]": 5, "xaxis3.range[1]": 7}, axis="step", xmap=None) == (5, 7)
    assert pick({"xaxis.range": [-3, 7]}, axis="step", xmap=None) == (0, 7)
    assert pick({"xaxis.autorange": True}, axis="step", xmap=None) is None  # double-click
    assert pick({"autosize": True}, axis="step", xmap=None) is False
    assert pick(None, axis="step", xmap=None) is False
    xmap = {"step": [0, 10, 20, 30], "ts": [T0, T0 + 10, T0 + 20, T0 + 30]}
    start = dt.datetime.fromtimestamp(T0 + 12).strftime("%Y-%m-%d %H:%M:%S.%f")[:-2]
    end = dt.datetime.fromtimestamp(T0 + 25).strftime("%Y-%m-%d %H:%M:%S")
    assert pick({"xaxis.range[0]": start, "xaxis.range[1]": end}, axis="time", xmap=xmap) == (
        10,
        30,
    )


def test_a_drag_is_applied_by_whichever_call_of_sync_comes_after_it() -> None:
    """Dash sends inputs that changed together in one call, in no set order, and drops an
    answer of a callback for a newer call of it: the newest drag (the ``run-drag`` store,
    numbered in the browser) is applied by any call that finds it not yet applied, and
    once only (a reset or back / forward is not undone by it)."""
    from sqlalchemy import create_engine

    from trainwarden.webui.app import create_dash
    from trainwarden.webui.client import LocalClient

    from .dash_call import dash_call

    app = create_dash(LocalClient(create_engine("sqlite://")))
    view = overview_query.parse_query("?rank=3")
    options = [{"label": m, "value": f"user.{m}"} for m in ("lr", "moe.aux")]
    drag = {"n": 1, "relayout": {"xaxis.range[0]": 10, "xaxis.range[1]": 20}}
    values = {
        "run-url.search": "?rank=3",
        "run-view.data": view,
        "run-axis.value": "step",
        "run-rank.value": 3,
        "run-user-metric.value": "user.moe.aux",
        "run-user-metric.options": options,
        "run-drag.data": drag,
    }
    # The drag and a pick together, in either order: both applied.
    for changed in (
        ["run-drag.data", "run-user-metric.value"],
        ["run-user-metric.value", "run-drag.data"],
    ):
        found = dash_call(app, "run-url.search", values, changed)
        assert found["run-url"] == {"search": "?from=10&to=20&rank=3&user=moe.aux"}, changed
        assert found["run-view"]["data"]["drag"] == 1
    # The drag's own call was dropped: the picker's call, which came after, applies it.
    found = dash_call(app, "run-url.search", values, ["run-user-metric.value"])
    assert found["run-url"] == {"search": "?from=10&to=20&rank=3&user=moe.aux"}
    applied = found["run-view"]["data"]
    # Applied once: "Whole run" clears the range, and the same drag does not come back.
    done = {**values, "run-view.data": applied, "run-url.search": "?from=10&to=20&rank=3"}
    found = dash_call(app, "run-url.search", done, ["run-reset.n_clicks"])
    assert found["run-url"] == {"search": "?rank=3&user=moe.aux"}
    # A double click (autorange) is a drag to the whole run.
    whole = {**done, "run-drag.data": {"n": 2, "relayout": {"xaxis.autorange": True}}}
    found = dash_call(app, "run-url.search", whole, ["run-drag.data"])
    assert found["run-url"] == {"search": "?rank=3&user=moe.aux"}
    # Back / forward in the browser: the address wins, and the drag before it is spent.
    back = {**values, "run-url.search": "?rank=1"}
    found = dash_call(app, "run-url.search", back, ["run-drag.data", "run-url.search"])
    assert "run-url" not in found
    assert found["run-view"]["data"] == {**overview_query.parse_query("?rank=1"), "drag": 1}


def test_a_refresh_sets_the_user_metric_picker_only_when_it_changed() -> None:
    """Each drawing of the overview re-reads the run's user metrics. Setting the picker's
    value fires the URL callback, and a call of it while a zoom's was in flight made
    Dash drop the zoom: a refresh that changes nothing sets nothing."""
    from sqlalchemy import create_engine

    from trainwarden.webui.app import create_dash
    from trainwarden.webui.client import LocalClient

    from .dash_call import dash_call

    class Metrics(LocalClient):
        found = ["user.lr", "user.moe.aux"]

        def extra_metrics(self, run: str) -> list[str]:
            return list(self.found)

    client = Metrics(create_engine("sqlite://"))
    app = create_dash(client)
    options = [{"label": m.removeprefix("user."), "value": m} for m in client.found]
    first = {
        "run-name.data": "r",
        "run-view.data": overview_query.parse_query("?user=moe.aux"),
        "run-xmap.data": {"step": [1], "ts": [1.0]},
    }
    # The page opens: the picker gets the run's metrics and the URL's pick.
    found = dash_call(app, "run-user-metric.options", first, ["run-xmap.data"])
    assert found == {"run-user-metric": {"options": options, "value": "user.moe.aux"}}
    # A refresh with the same metrics and pick: nothing is set (so `sync` does not fire).
    again = {**first, "run-user-metric.options": options, "run-user-metric.value": "user.moe.aux"}
    assert dash_call(app, "run-user-metric.options", again, ["run-xmap.data"]) == {}
    # A new metric appears: the options change, the pick stays.
    client.found = [*client.found, "user.tokens_dropped"]
    found = dash_call(app, "run-user-metric.options", again, ["run-xmap.data"])
    assert found == {
        "run-user-metric": {
            "options": [*options, {"label": "tokens_dropped", "value": "user.tokens_dropped"}]
        }
    }


def test_a_refresh_between_a_pick_and_its_record_keeps_the_pick_and_the_address_sets_it() -> None:
    """A refresh called after a click on the picker but before ``sync`` has put the
    pick in the view must not put the old pick back (a browser test lost its click so);
    back / forward in the browser sets the picker from the address."""
    from sqlalchemy import create_engine

    from trainwarden.webui.app import create_dash
    from trainwarden.webui.client import LocalClient

    from .dash_call import dash_call

    class Metrics(LocalClient):
        def extra_metrics(self, run: str) -> list[str]:
            return ["user.aux", "user.lr"]

    app = create_dash(Metrics(create_engine("sqlite://")))
    options = [{"label": m, "value": f"user.{m}"} for m in ("aux", "lr")]
    clicked = {
        "run-name.data": "r",
        "run-view.data": overview_query.parse_query(""),  # no pick recorded yet: the default
        "run-xmap.data": {"step": [1], "ts": [1.0]},
        "run-user-metric.options": options,
        "run-user-metric.value": "user.lr",  # just clicked
    }
    assert dash_call(app, "run-user-metric.options", clicked, ["run-xmap.data"]) == {}
    # A metric the run no longer has is replaced by the default.
    gone = {**clicked, "run-user-metric.value": "user.old"}
    found = dash_call(app, "run-user-metric.options", gone, ["run-xmap.data"])
    assert found == {"run-user-metric": {"value": "user.aux"}}
    values = {
        "run-view.data": overview_query.parse_query("?user=lr"),
        "run-axis.value": "step",
        "run-user-metric.value": "user.lr",
        "run-user-metric.options": options,
    }
    for search, shown in (("?", "user.aux"), ("?user=lr", None), ("?rank=2&user=aux", "user.aux")):
        found = dash_call(
            app, "run-url.search", {**values, "run-url.search": search}, ["run-url.search"]
        )
        assert found.get("run-user-metric", {}).get("value") == shown, search


def test_the_ranks_panel_of_a_big_run_lists_those_in_trouble_not_every_rank() -> None:
    from types import SimpleNamespace

    from trainwarden.webui.pages.overview.panels import PANEL_RANKS, ranks_panel

    def r(n: int, state: str) -> SimpleNamespace:
        return SimpleNamespace(
            rank=n,
            node=f"node{n // 8}",
            host="h",
            state=state,
            state_detail=None,
            last_step=10,
            gpu=None,
        )

    run = SimpleNamespace(
        name="big run", ranks=[r(i, "finished") for i in range(1024)] + [r(1024, "hung")]
    )
    from dash import dcc, html

    from .helpers import walk

    def rows(panel: object) -> int:
        return sum(isinstance(c, html.Tr) for c in walk(panel)) - 1  # less the header row

    panel = ranks_panel(run, [], [])
    assert rows(panel) == 1  # the hung rank only: a thousand-row table takes the browser minutes
    texts = [
        k
        for c in walk(panel)
        for k in (c.children if isinstance(c.children, list) else [c.children])
        if isinstance(k, str)
    ]
    assert any("1 of 1025 ranks listed" in t for t in texts), texts
    assert [c.href for c in walk(panel) if isinstance(c, dcc.Link)] == ["/runs/big%20run/ranks"]
    small = SimpleNamespace(name="s", ranks=[r(i, "healthy") for i in range(PANEL_RANKS)])
    assert rows(ranks_panel(small, [], [])) == PANEL_RANKS


def test_an_xid_event_reads_with_the_catalogs_words_when_it_has_only_its_code() -> None:
    def xid(data: dict[str, object]) -> str:
        event = EventOut(
            id=1, kind="xid", severity="critical", ts=1.0, recv_ts=1.0, rank=1, step=50, data=data
        )
        return overview_panels._event_text(event)

    # Only the code (an older agent, a hand-written event): looked up, never "None".
    assert xid({"code": 79}) == (
        "XID 79 GPU has fallen off the bus: The GPU no longer answers on PCIe: a hardware, "
        "power or thermal fault. Action: drain the node."
    )
    # What the agent sent wins over the catalog.
    sent = {"code": 79, "name": "n", "meaning": "m.", "action": "reboot_node"}
    assert xid(sent) == "XID 79 n: m. Action: reboot the node."
    assert "None" not in xid({})
