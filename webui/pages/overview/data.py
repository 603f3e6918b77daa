"""What the overview reads through the client: the figure's series, spikes, outlier
ranks' lines and markers (the whole run, or the view's range read again at full detail:
at most :data:`POINTS` points a series, downsampled on the server so spikes survive),
the user metric's figure, the run's open alerts and the hang banner."""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainwarden.agent import metric_catalog as catalog

from ...charts import empty_figure, themed
from ...client import Client
from ...components import notice
from ..alerts.panels import run_alerts_panel
from ..alerts.query import OPEN
from ..ranks import collectives_panel as coll
from .figures import REPLACED, Marker, Overview, RankLine, user_figure
from .traces import thin

log = logging.getLogger(__name__)
POINTS = 1_000  # per series: about one per pixel of a wide screen
METRICS = [m.name for m in catalog.METRICS if m.overview]
LOSS_FLAGS = ("loss_spike", "nonfinite_loss")
SPIKE_FLAGS = (*LOSS_FLAGS, "grad_norm_spike", "nonfinite_grad_norm")
MAX_RANK_LINES = 3
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="trainwarden-ui-query")


def _step_at(ts: float, steps: list[int], times: list[float]) -> int:
    """The step running at ``ts`` (the first or last one outside the run's span)."""
    i = bisect.bisect_right(times, ts) - 1
    return steps[max(0, min(i, len(steps) - 1))]


def markers(
    client: Client, name: str, *, steps: list[int], times: list[float], zoomed: bool
) -> list[Marker]:
    """Fired alerts, finished actions, checkpoints and restarts. A marker with no step of
    its own is placed at the step running at its time (or at the run's last step)."""
    found: list[Marker] = []
    for a in client.alerts(run=name, limit=500):
        if a.fired_at is None:
            continue
        where = f" rank {a.rank}" if a.rank is not None else ""
        tone = {"critical": "bad", "warning": "warn"}.get(a.severity, "info")
        found.append(
            Marker(
                "alert",
                a.fired_at,
                a.fired_at_step,  # None (an alert fired before 0019): the step running then
                f"alert {a.rule}{where} ({a.severity}, {a.state})",
                tone,
            )
        )
    for ac in client.actions(run=name, limit=200):
        if ac.state not in ("done", "failed"):
            continue
        why = f": {ac.reason}" if ac.reason else ""
        found.append(
            Marker(
                "action",
                ac.finished_at or ac.updated_at,
                None,
                f"action {ac.kind} {ac.state}{why}",
                "good" if ac.state == "done" else "bad",
            )
        )
    for c in client.checkpoints(name):
        found.append(
            Marker(
                "checkpoint",
                c.ts,
                c.step,
                f"checkpoint at step {c.step}: " + ("good" if c.good else f"suspect, {c.suspect}"),
                "good" if c.good else "warn",
            )
        )
    for e in client.events(name, kind="restart"):
        where = f"rank {e.rank} " if e.rank is not None else ""
        found.append(Marker("restart", e.ts, e.step, f"{where}restarted", "info"))
    placed = []
    for mk in found:
        if mk.step is None and steps:
            if zoomed and not times[0] <= mk.ts <= times[-1]:
                continue
            mk = Marker(mk.kind, mk.ts, _step_at(mk.ts, steps, times), mk.text, mk.tone)
        if zoomed and mk.step is not None and not steps[0] <= mk.step <= steps[-1]:
            continue
        placed.append(mk)
    return placed


def outlier_ranks(
    loss: Any, spikes: list[tuple[int, int, str, float | None]], *, wanted: int | None
) -> list[tuple[int, str]]:
    """Ranks worth a line of their own on the loss row, at most :data:`MAX_RANK_LINES`:
    the rank in the URL, ranks with loss spikes (most first), and a rank that holds the
    highest loss on most steps (with 3 ranks or more: with 2, one is always highest)."""
    picked: list[tuple[int, str]] = [(wanted, "selected")] if wanted is not None else []
    counts = Counter(rank for _, rank, flag, _ in spikes if flag in LOSS_FLAGS)
    for rank, n in counts.most_common():
        picked.append((rank, f"{n} loss spike{'s' if n != 1 else ''}"))
    if loss.step and max(loss.n, default=0) >= 3:
        top = Counter(r for r in loss.argmax_rank if r is not None).most_common(1)
        if top and top[0][1] >= 0.5 * len(loss.step):
            picked.append(
                (top[0][0], f"highest loss on {top[0][1] / len(loss.step):.0%} of points")
            )
    out: list[tuple[int, str]] = []
    for rank, why in picked:
        if all(rank != r for r, _ in out):
            out.append((rank, why))
    return out[:MAX_RANK_LINES]


def load(client: Client, name: str, view: dict[str, Any]) -> Overview:
    """Everything the figure draws, for the view's range (the whole run when none)."""
    lo, hi = view.get("from"), view.get("to")
    # The series queries run side by side (the database works, Python waits): a run of a
    # thousand ranks draws in about the time of its slowest query, not of their sum.
    futures = {
        m: _POOL.submit(client.series, name, m, points=POINTS, from_step=lo, to_step=hi)
        for m in METRICS
    }
    series = {m: f.result() for m, f in futures.items()}
    base = series["step_time"] if series["step_time"].step else series["loss"]
    spikes = [
        (f.step, f.rank, flag, f.loss if flag in LOSS_FLAGS else f.grad_norm)
        for f in client.flags(name)
        if (lo is None or f.step >= lo) and (hi is None or f.step <= hi)
        for flag in f.flags
        if flag in SPIKE_FLAGS
    ]
    lines = []
    for rank, why in outlier_ranks(series["loss"], spikes, wanted=view.get("rank")):
        rs = client.rank_series(name, rank, "loss", from_step=lo, to_step=hi)
        if rs.step:
            lines.append(RankLine(rank, why, *thin(rs.step, rs.ts, rs.value, POINTS)))
    zoomed = lo is not None or hi is not None
    found = markers(client, name, steps=list(base.step), times=list(base.ts), zoomed=zoomed)
    replaced = {
        m: client.replaced(name, m, points=POINTS, from_step=lo, to_step=hi) for m in REPLACED
    }
    return Overview(
        series=series,
        spikes=spikes,
        ranks=lines,
        markers=found,
        replaced={m: r for m, r in replaced.items() if r.step},
    )


def range_label(data: Overview, view: dict[str, Any]) -> str:
    base = data.series.get("step_time")
    if base is None or not base.step:
        return ""
    per = f" · 1 point = {base.bucket} steps" if base.bucket > 1 else ""
    if view.get("from") is None and view.get("to") is None:
        return f"Whole run: steps {base.step[0]:,}–{base.step[-1]:,}{per} · live"
    first = view.get("from") or 0
    last = view["to"] if view.get("to") is not None else base.step[-1]
    return f"Steps {first:,}–{last:,}{per}"


def run_alerts(client: Client, name: str) -> Any:
    """The run's open alerts; an error here leaves the rest of the run page alone."""
    try:
        found = client.alerts(run=name, states=OPEN, limit=20)
    except Exception as exc:
        log.exception("run page alerts %s", name)
        return notice(
            f"Cannot read this run's alerts: {exc.__class__.__name__}. Retrying.", "error"
        )
    return run_alerts_panel(found, run=name, now=time.time())


def hang_banner(client: Client, run: Any) -> Any:
    """One line at the top while ranks are hung and the collector names the rank they
    wait on (or a desync), linking to the ranks page's Collectives section.

    Shown while the health evaluator holds a rank hung, not while the verdict is newer
    than the last step: the hung state clears by itself when steps complete again, and
    it compares no rank's clock with the collector's. A run with no hung rank costs no
    query. An error here leaves the rest of the page alone."""
    hung = sum(1 for r in run.ranks if r.state == "hung")
    if not hung:  # a job that died in a collective: the same story, and how it ended
        return coll.lost_banner(run)
    try:
        view = client.collectives(run.name)
    except Exception:
        log.exception("run page collectives %s", run.name)
        return None
    return coll.banner(view, run=run.name, hung=hung)


USER_HINT = (
    "No learning rate and no metrics of your own in this run: log them inside the step "
    "with s.lr(value) and s.metric(name, value) (an eval loss, an MoE aux loss)."
)


def user_part(
    client: Client, name: str, view: dict[str, Any], metric: str | None, theme: str | None
) -> Any:
    """The picked user metric (else the run's first) across ranks, over the view's range."""
    if not metric:
        found = client.extra_metrics(name)
        if not found:
            return themed(empty_figure(USER_HINT), theme)
        metric = found[0]
    axis = view.get("axis", "step")
    series = client.series(
        name, metric, points=POINTS, from_step=view.get("from"), to_step=view.get("to")
    )
    return user_figure(series, axis=axis, theme=theme, revision=f"{name}|{axis}|{metric}")
