"""What the ranks page reads through the client, and the parts it draws of it: a
heatmap, the user metric's heatmap, the rank states with one rank's detail, and the
Collectives section."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from dash import dcc, html

from ... import components
from ...charts import empty_figure, themed
from ...client import Client, may_change
from ...components import metric_label, notice, parse_user
from . import collectives_panel as coll
from . import figures as rf
from .panels import rank_facts, states_table
from .query import parse_query, query_string

BUCKETS = 200  # heatmap columns; the collector buckets the steps
GPU_SAMPLES = 20_000  # newest GPU readings read for the temperature heatmap
DETAIL_STEPS = 5_000  # one rank's detail: the newest steps when no range is chosen
HEATMAPS = ("step_time", "exposed_comm", "loss_dev", "gpu_temp")
STEP_HEATMAPS = HEATMAPS[:3]
HINT = html.P(
    "Click a heatmap cell or a rank number for that rank's detail. Drag across a step "
    "heatmap to zoom into those steps; double-click to see the whole run. The address bar "
    "keeps the rank and the range: share it.",
    className="hint",
)
TITLES = {
    "step_time": "Step time",
    "exposed_comm": "Exposed communication",
    "loss_dev": "Loss deviation from the median rank",
    "gpu_temp": "GPU temperature (by time)",
}


def heatmap_part(client: Client, name: str, key: str, search: str | None, theme: str | None) -> Any:
    """One of the page's heatmaps (``key`` in HEATMAPS) as a figure."""
    rank, lo, hi = parse_query(search)
    title = TITLES[key]
    revision = f"{name}:{key}"
    if key == "gpu_temp":
        grid = rf.gpu_grid(client.gpu(name, limit=GPU_SAMPLES))
        return rf.heatmap_figure(
            grid,
            title=title,
            theme=theme,
            revision=revision,
            x_title="time",
            selected=rank,
            empty="No GPU temperatures: the agents report none "
            "(no NVML on their hosts). Other heatmaps are unaffected.",
        )
    metric = "loss" if key == "loss_dev" else key
    grid = rf.grid_of(client.heatmap(name, metric, buckets=BUCKETS, from_step=lo, to_step=hi))
    if key == "loss_dev":
        if len(grid.ranks) == 1:
            return themed(empty_figure("One rank: no peers to compare its loss with."), theme)
        grid = rf.deviation(grid)
        empty = "No loss yet: the trainer reports it with s.loss(value)."
        return rf.heatmap_figure(
            grid,
            title=title,
            theme=theme,
            revision=revision,
            selected=rank,
            diverging=True,
            empty=empty,
        )
    title = _stands_out(title, rf.stripes(grid))
    empty = (
        "No exposed-communication times: the agent splits communication when "
        "torch.distributed is initialised (comm split)."
        if key == "exposed_comm"
        else "No steps yet: the heatmap fills as the ranks report."
    )
    return rf.heatmap_figure(
        grid, title=title, theme=theme, revision=revision, selected=rank, empty=empty
    )


def _stands_out(title: str, found: list[tuple[int, float]]) -> str:
    """A heatmap's title naming the ranks whose row stands out."""
    if not found:
        return title
    return title + " · stands out: " + ", ".join(f"rank {r} ({x:.1f}× its peers)" for r, x in found)


USER_EMPTY = (
    "No learning rate and no user metrics in this run: log them inside the step with "
    "s.lr(value) and s.metric(name, value) (an MoE router's load, an eval loss) and pick "
    "one here."
)


def user_choices(
    client: Client, name: str, search: str | None
) -> tuple[list[dict[str, str]], str | None]:
    """:func:`trainwarden.webui.components.user_choices` with the pick of the page's URL."""
    return components.user_choices(client, name, parse_user(search))


def user_heatmap_part(
    client: Client, name: str, metric: str | None, search: str | None, theme: str | None
) -> Any:
    """The chosen user metric (else the run's first) per rank and step bucket (the max
    per cell)."""
    rank, lo, hi = parse_query(search)
    if not metric:
        names = client.extra_metrics(name)
        if not names:
            return themed(empty_figure(USER_EMPTY), theme)
        metric = names[0]
    grid = rf.grid_of(client.heatmap(name, metric, buckets=BUCKETS, from_step=lo, to_step=hi))
    kind = "User metric " if metric.startswith("user.") else ""
    title = f"{kind}{metric_label(metric)} (max per cell)"
    # "x times its peers" means something for a metric that cannot go below zero only.
    positive = all(v is None or v >= 0 for row in grid.values for v in row)
    title = _stands_out(title, rf.stripes(grid) if positive else [])
    return rf.heatmap_figure(
        grid,
        title=title,
        theme=theme,
        revision=f"{name}:user:{metric}",
        selected=rank,
        empty=f"No values of {metric_label(metric)} in these steps.",
    )


def states_part(
    client: Client, name: str, search: str | None, theme: str | None, *, run: Any = None
) -> tuple[Any, Any, Any]:
    """(notice, rank states, the selected rank's detail); ``run``: the run, if read."""
    rank, lo, hi = parse_query(search)
    run = run or client.get_run(name)
    note = None
    if run.last_step is None:
        note = notice(f"Run {name!r} has no steps yet: the heatmaps fill as its ranks report.")
    elif len(run.ranks) == 1:
        note = notice("This run has one rank: there are no peers to compare it with.")
    keep = query_string(None, lo, hi, user=parse_user(search)).lstrip("?")
    states = states_table(name, run.ranks, selected=rank, keep=keep)
    if rank is None:
        return note, states, HINT
    info = next((r for r in run.ranks if r.rank == rank), None)
    if info is None:
        known = f"ranks {run.ranks[0].rank}–{run.ranks[-1].rank}" if run.ranks else "no ranks yet"
        return (
            note,
            states,
            notice(f"Rank {rank} has not reported in run {name!r} ({known}).", "error"),
        )
    last = None if lo is not None or hi is not None else DETAIL_STEPS
    mine = client.rank_series(name, rank, "step_time", from_step=lo, to_step=hi, last=last)
    everyone = client.series(name, "step_time", points=1_000, from_step=lo, to_step=hi, last=last)
    gpu = client.gpu(name, rank=rank, limit=1)
    events = [e for e in client.events(name) if e.rank == rank]
    figure = rf.rank_figure(mine, everyone, theme=theme, revision=f"{name}:rank")
    base = f"/runs/{quote(name, safe='')}"
    clear = dcc.Link("close", href=f"{base}/ranks{'?' + keep if keep else ''}")
    hardware = dcc.Link("its GPU", href=f"{base}/hardware?rank={rank}")
    return (
        note,
        states,
        html.Div(
            [
                html.H3(
                    [
                        f"Rank {rank}",
                        html.Span(" · ", className="fact-key"),
                        hardware,
                        html.Span(" · ", className="fact-key"),
                        clear,
                    ]
                ),
                rank_facts(info, gpu[-1] if gpu else None, events),
                dcc.Graph(id="ranks-rank-graph", figure=figure, config={"displaylogo": False}),
            ],
            className="rank-detail",
        ),
    )


def collectives_part(client: Client, name: str, *, hung: int) -> tuple[Any, Any]:
    """(above the rank states, at the bottom of the page): the verdict on the ranks'
    Flight Recorder rings, or one line saying there are none yet (with a button for a
    session that may ask the ranks for them), in one of the two; ``hung``: how many of
    the run's ranks are hung now."""
    return coll.placed(client.collectives(name), hung=hung, may_change=may_change())
