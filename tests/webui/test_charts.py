from __future__ import annotations

from trainwarden.collector.read.schemas import Series
from trainwarden.webui import charts


def series(metric: str = "loss", steps: int = 3) -> Series:
    xs = list(range(steps))
    return Series(
        run="r",
        metric=metric,
        unit="",
        step=xs,
        ts=[float(x) for x in xs],
        n=[2] * steps,
        min=[1.0] * steps,
        median=[1.5] * steps,
        max=[2.0] * steps,
        total=[3.0] * steps,
        argmax_rank=[1] * steps,
    )


def test_band_figure_draws_min_max_band_and_median() -> None:
    fig = charts.band_figure(series(), title="Loss", revision="r")
    names = [t.name for t in fig.data]
    assert names == ["max", "min..max across ranks", "median"]
    assert fig.data[1].fill == "tonexty"
    assert list(fig.data[2].y) == [1.5, 1.5, 1.5]
    assert fig.layout.uirevision == "r"  # live refresh keeps the user's zoom


def test_total_figure_plots_the_run_level_value() -> None:
    fig = charts.total_figure(series("tokens_per_s"), title="Throughput", revision="r")
    assert list(fig.data[0].y) == [3.0, 3.0, 3.0]


def test_empty_series_says_what_is_happening() -> None:
    fig = charts.band_figure(series(steps=0), title="Loss", revision="r")
    assert fig.data == ()
    assert "waiting for the first steps" in fig.layout.annotations[0].text
