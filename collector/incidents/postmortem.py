"""Post-mortem reports: a run's incidents with their timelines and figures, as Markdown
(GitHub or Slack flavour), a self-contained HTML page with Plotly charts of each
incident's window (plotly.js inline: it opens offline), or JSON for tools; and posting
a report to a Slack-compatible or generic webhook.

``report_of`` reads the database and returns plain data; the renderers are pure
functions of it, so the CLI renders what it fetched from a collector
(``GET /api/v1/runs/{run}/postmortem?format=json``) exactly as the collector would.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, select

from trainwarden.collector.incidents.store import list_incidents
from trainwarden.collector.incidents.timeline import DEFINITIONS, timeline
from trainwarden.collector.read.economics import EconomicsSettings, goodput
from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.store import models as m

CHART_POINTS = 2000
CHART_METRICS = (("loss", "Loss"), ("step_time", "Step time (s)"), ("mfu", "MFU"))
# MFU as a percentage to two significant digits, here and in the run overview: "0.45%" on a
# small model or a CPU (a whole percent printed 0% on every tick), "38%" on a real one;
# never an SI "4.5m".
MFU_FORMAT = ".2~p"
FIGURES = (
    ("detect_s", "Time to detect"),
    ("page_s", "Time to page"),
    ("act_s", "Time to act"),
    ("recover_s", "Time to recover"),
)

GOODPUT_KEYS = (
    "ettr",
    "wall_s",
    "attempts",
    "interruptions",
    "replayed_steps",
    "gpu_hours",
    "price_per_gpu_hour",
    "cost",
)
"""What the report keeps of the run's goodput (``collector/read/economics.py``)."""

# -- gathering -------------------------------------------------------------------------------


def report_of(
    conn: Connection,
    *,
    run: str,
    incident_id: int | None = None,
    price_per_gpu_hour: float | None = None,
    base_url: str = "",
    now: float | None = None,
    charts: bool = True,
) -> dict[str, Any]:
    """The post-mortem of ``run``: every incident (or only ``incident_id``), each with its
    timeline, derived figures and the chart data of its window; plus the run's notes."""
    now = time.time() if now is None else now
    ru = conn.execute(select(m.runs).where(m.runs.c.name == run)).first()
    if ru is None:
        raise NotFound(f"run {run!r} not found")
    ids = (
        [incident_id]
        if incident_id is not None
        else [i["id"] for i in list_incidents(conn, run=run)]
    )
    incidents = []
    for i in ids:
        t = timeline(
            conn,
            run=run,
            incident_id=i,
            now=now,
            price_per_gpu_hour=price_per_gpu_hour,
            base_url=base_url,
        )
        if charts:
            t["charts"] = chart_data(
                conn,
                run_id=ru.id,
                start=t["window"]["start"],
                end=t["window"]["end"],
                ranks=t["incident"]["ranks"],
            )
        incidents.append(t)
    n = m.notes.c
    notes = [
        {"at": r.at, "author": r.author, "text": r.text, "step": r.step, "incident": r.incident_id}
        for r in conn.execute(select(m.notes).where(n.run_id == ru.id).order_by(n.at, n.id))
    ]
    good = goodput(
        conn, ru.id, settings=EconomicsSettings(price_per_gpu_hour=price_per_gpu_hour), now=now
    )
    return {
        "kind": "trainwarden.postmortem",
        "version": 1,
        "generated_at": now,
        "run": {
            "name": ru.name,
            "world_size": ru.world_size,
            "status": ru.status,
            "created_at": ru.created_at,
            "updated_at": ru.updated_at,
            "last_step": ru.last_step,
        },
        "goodput": {k: good[k] for k in GOODPUT_KEYS},
        "incident_filter": incident_id,
        "price_per_gpu_hour": price_per_gpu_hour,
        "incidents": incidents,
        "notes": notes,
        "definitions": DEFINITIONS,
    }


def _thin(rows: Sequence[Any], points: int) -> list[Any]:
    stride = max(1, -(-len(rows) // points))
    return list(rows[::stride])


def chart_data(
    conn: Connection,
    *,
    run_id: int,
    start: float,
    end: float,
    ranks: list[int],
    points: int = CHART_POINTS,
) -> dict[str, Any]:
    """Loss, step time and MFU across ranks (median, min, max per step) and the GPU
    temperature of the involved ranks (all ranks, up to 8, when none is named) over
    ``start``..``end``."""
    s = m.step_stats.c
    out: dict[str, Any] = {}
    for metric, _label in CHART_METRICS:
        rows = conn.execute(
            select(s.step, s.ts, s.median, s.min, s.max)
            .where(s.run_id == run_id, s.metric == metric, s.ts >= start, s.ts <= end)
            .order_by(s.ts, s.step)
        ).all()
        kept = _thin(rows, points)
        out[metric] = {
            k: [getattr(r, k) for r in kept] for k in ("step", "ts", "median", "min", "max")
        }
    g = m.gpu_samples.c
    chosen = (
        list(ranks)
        or sorted(conn.execute(select(m.ranks.c.rank).where(m.ranks.c.run_id == run_id)).scalars())[
            :8
        ]
    )
    temp: dict[str, Any] = {}
    for rank in chosen:
        samples = conn.execute(
            select(g.ts, g.temp_c)
            .where(g.run_id == run_id, g.rank == rank, g.ts >= start, g.ts <= end)
            .order_by(g.ts)
        ).all()
        kept = _thin(samples, points)
        temp[str(rank)] = {"ts": [r.ts for r in kept], "temp_c": [r.temp_c for r in kept]}
    out["temp_c"] = temp
    return out


# -- formatting helpers --------------------------------------------------------------------------


def clock(ts: float | None, *, ms: bool = True) -> str:
    if ts is None:
        return "-"
    d = datetime.fromtimestamp(ts, tz=timezone.utc)
    return (
        d.strftime("%Y-%m-%d %H:%M:%S") + (f".{d.microsecond // 1000:03d}" if ms else "") + " UTC"
    )


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    sign, s = ("-" if seconds < 0 else ""), abs(seconds)
    if s < 60:
        return f"{sign}{s:.1f} s"
    if s < 3600:
        return f"{sign}{int(s // 60)} min {s % 60:.0f} s"
    return f"{sign}{int(s // 3600)} h {int(s % 3600 // 60)} min"


def figure_lines(f: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs of an incident's figures, in reading order."""
    out = [(label, duration(f.get(key))) for key, label in FIGURES]
    out.append(("Steps lost", str(f.get("steps_lost", 0))))
    out.append(("Time lost", duration(f.get("time_lost_s"))))
    gh = f.get("gpu_hours_lost")
    out.append(("GPU-hours lost", "n/a" if gh is None else f"{gh:.3f} ({f['world_size']} GPUs)"))
    price, cost = f.get("price_per_gpu_hour"), f.get("cost")
    if cost is not None:
        out.append(("Cost", f"{cost:.2f} at {price:g} per GPU-hour"))
    else:
        out.append(("Cost", "n/a (no price per GPU-hour given)" if price is None else "n/a"))
    return out


def goodput_line(g: dict[str, Any] | None) -> str | None:
    """The run's goodput in a line: ETTR, GPU-hours used and lost, and the money when a
    price is set (None for a report from a collector that has no goodput)."""
    if not g:
        return None
    ettr = "n/a" if g.get("ettr") is None else f"{g['ettr']:.1%}"
    hours = g.get("gpu_hours") or {}
    line = (
        f"ETTR {ettr} over {duration(g.get('wall_s'))} and {g.get('attempts', 0)} attempt(s) "
        f"({g.get('interruptions', 0)} interruption(s), {g.get('replayed_steps', 0)} steps replayed); "
        f"GPU-hours used {hours.get('used', 0.0):.3f}, lost {hours.get('lost', 0.0):.3f}"
    )
    cost = g.get("cost")
    if cost is not None:
        line += (
            f"; cost {cost['used']:.2f} used, {cost['lost']:.2f} lost at "
            f"{g['price_per_gpu_hour']:g} per GPU-hour"
        )
    return line


def _where(e: dict[str, Any]) -> str:
    parts = []
    if e.get("rank") is not None:
        parts.append(f"rank {e['rank']}")
    if e.get("node"):
        parts.append(str(e["node"]))
    return " ".join(parts)


def _title(t: dict[str, Any]) -> str:
    i = t["incident"]
    return f"Incident {i['id']}: {i['title']} ({i['state']})"


# -- Markdown ----------------------------------------------------------------------------------


def render_markdown(report: dict[str, Any], *, flavor: str = "github") -> str:
    """GitHub-flavoured Markdown, or Slack's mrkdwn (``flavor="slack"``): headings as bold
    lines, ``<url|text>`` links, bullet lists rather than tables (Slack has none)."""
    slack = flavor == "slack"

    def bold(s: str) -> str:
        return f"*{s}*" if slack else f"**{s}**"

    def heading(s: str, level: int) -> str:
        return bold(s) if slack else f"{'#' * level} {s}"

    def link(text: str, url: str) -> str:
        return f"<{url}|{text}>" if slack else f"[{text}]({url})"

    run = report["run"]
    lines = [heading(f"Post-mortem: run `{run['name']}`", 1), ""]
    lines.append(
        f"_{len(report['incidents'])} incident(s); world size {run['world_size']}; "
        f"run {run['status']}, last step {run['last_step']}; generated {clock(report['generated_at'], ms=False)}_"
    )
    lines.append("")
    if good := goodput_line(report.get("goodput")):
        lines += [f"{bold('Goodput')}: {good}", ""]
    if not report["incidents"]:
        lines.append("No incidents: no alert of this run fired and nobody opened one.")
        lines.append("")
    for t in report["incidents"]:
        i, f = t["incident"], t["figures"]
        lines += [heading(_title(t), 2), ""]
        scope = f"severity {i['severity']}; opened {clock(i['opened_at'])} by {i['opened_by']}"
        if i["closed_at"]:
            scope += f"; closed {clock(i['closed_at'])} by {i['closed_by']}"
        if i["ranks"] or i["nodes"]:
            scope += f"; ranks {', '.join(map(str, i['ranks'])) or '-'}; nodes {', '.join(i['nodes']) or '-'}"
        lines += [scope, ""]
        if i.get("summary"):
            lines += [f"> {i['summary']}", ""]
        if f.get("fault"):
            lines += [f"{bold('Fault')}: {f['fault']} at {clock(f['fault_at'])}", ""]
        lines += [
            f"• {bold(label)}: {value}" if slack else f"- {bold(label)}: {value}"
            for label, value in figure_lines(f)
        ]
        lines += ["", heading("Timeline", 3), ""]
        for e in t["entries"]:
            where = _where(e)
            bits = [f"`{clock(e['at'])[11:23]}`"]
            if e["step"] is not None:
                bits.append(f"step {e['step']}")
            bits.append(f"{e['source']}/{e['kind']}")
            if where:
                bits.append(where)
            text = e["text"].replace("\n", " ")
            if e["severity"] in ("critical", "warning"):
                text = f"{text} ({e['severity']})"
            if e.get("runbook_url"):
                text += " " + link("runbook", e["runbook_url"])
            lines.append(("• " if slack else "- ") + " · ".join(bits) + " — " + text)
        lines.append("")
    if report["notes"]:
        lines += [heading("Logbook", 2), ""]
        lines += [f"- `{clock(n['at'])}` {n['author']}: {n['text']}" for n in report["notes"]]
        lines.append("")
    if report["incidents"]:
        lines += [heading("How the figures are computed", 3) if not slack else "", ""]
        if not slack:
            lines += [f"- {k}: {v}" for k, v in report["definitions"].items()]
    return "\n".join(lines).rstrip() + "\n"


# -- JSON ----------------------------------------------------------------------------------------


def render_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=False, default=str) + "\n"


# -- HTML --------------------------------------------------------------------------------------

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1200px;color:#1d232b;padding:0 1rem}
h1{font-size:1.6rem}h2{margin-top:2.5rem;border-bottom:1px solid #ccd;padding-bottom:.3rem}
table{border-collapse:collapse;width:100%;font-size:.88rem}td,th{border-bottom:1px solid #e3e6ea;padding:.3rem .5rem;text-align:left;vertical-align:top}
th{background:#f4f6f8}.sev-critical{color:#b00020;font-weight:600}.sev-warning{color:#a15c00}
.figs{display:grid;grid-template-columns:repeat(auto-fill,minmax(210px,1fr));gap:.6rem;margin:1rem 0}
.fig{border:1px solid #dde;border-radius:6px;padding:.5rem .8rem}.fig b{display:block;font-size:1.2rem}
.muted{color:#667}code{font-size:.85rem}.none{padding:2rem;border:1px dashed #aab;border-radius:6px}
"""


def _plot_time(ts: float) -> str:
    """UTC as Plotly reads dates: it takes no zone offset (``+00:00`` draws NaN paths)."""
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")


def _chart(t: dict[str, Any], div_id: str) -> str:
    # plotly: ~0.5 s to import, and only the HTML report needs it (not Markdown or JSON)
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    c, f = t["charts"], t["figures"]
    titles = [label for _, label in CHART_METRICS] + ["GPU temperature (°C)"]
    fig = make_subplots(
        rows=4, cols=1, shared_xaxes=True, subplot_titles=titles, vertical_spacing=0.06
    )

    def x(ts: list[float]) -> list[str]:
        return [_plot_time(v) for v in ts]

    for row, (metric, label) in enumerate(CHART_METRICS, start=1):
        d = c[metric]
        value = "%{y}"
        if metric == "mfu":  # "0.45%", never "0.0045"
            fig.update_yaxes(tickformat=MFU_FORMAT, row=row, col=1)
            value = f"%{{y:{MFU_FORMAT}}}"
        fig.add_trace(
            go.Scatter(
                x=x(d["ts"]),
                y=d["max"],
                name=f"{label} max",
                line={"width": 0},
                showlegend=False,
                hoverinfo="skip",
            ),
            row=row,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=x(d["ts"]),
                y=d["min"],
                name=f"{label} min",
                fill="tonexty",
                line={"width": 0},
                showlegend=False,
                hoverinfo="skip",
            ),
            row=row,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=x(d["ts"]),
                y=d["median"],
                name=label,
                mode="lines",
                customdata=d["step"],
                hovertemplate=f"step %{{customdata}}: {value}<extra></extra>",
            ),
            row=row,
            col=1,
        )
    for rank, d in c["temp_c"].items():
        fig.add_trace(
            go.Scatter(x=x(d["ts"]), y=d["temp_c"], name=f"rank {rank} °C", mode="lines"),
            row=4,
            col=1,
        )
    marks = (
        ("fault_at", "fault", "#b00020"),
        ("pending_at", "pending", "#a15c00"),
        ("firing_at", "firing", "#d32f2f"),
        ("paged_at", "paged", "#6a1b9a"),
        ("acted_at", "action", "#1565c0"),
        ("recovered_at", "recovered", "#2e7d32"),
    )
    for key, label, color in marks:
        if f.get(key) is not None:
            at = _plot_time(f[key])
            fig.add_vline(x=at, line={"color": color, "dash": "dot", "width": 1})
            fig.add_annotation(
                x=at,
                y=1.02,
                yref="paper",
                text=label,
                showarrow=False,
                font={"color": color, "size": 10},
                textangle=-30,
            )
    # A panel with no data (MFU of a run without FLOPs) would guess a linear axis and
    # draw the time marks at NaN: every panel is a time axis.
    fig.update_xaxes(type="date")
    fig.update_xaxes(title_text="UTC", row=4, col=1)
    fig.update_layout(
        height=900,
        margin={"l": 60, "r": 20, "t": 60, "b": 40},
        template="plotly_white",
        legend={"orientation": "h"},
    )
    return str(fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id))


def render_html(report: dict[str, Any]) -> str:
    """One self-contained page: plotly.js is inlined, so it opens with no network."""
    from plotly.offline import get_plotlyjs  # plotly: HTML reports only (see _chart)

    esc = html.escape
    run = report["run"]
    body = [
        f"<h1>Post-mortem: run <code>{esc(run['name'])}</code></h1>",
        f"<p class='muted'>{len(report['incidents'])} incident(s) · world size {run['world_size']} · "
        f"run {esc(str(run['status']))}, last step {run['last_step']} · generated {clock(report['generated_at'], ms=False)}</p>",
    ]
    if good := goodput_line(report.get("goodput")):
        body.append(f"<p id='goodput'><b>Goodput</b>: {esc(good)}</p>")
    if not report["incidents"]:
        body.append(
            "<p class='none' id='no-incidents'>No incidents: no alert of this run fired and nobody opened one.</p>"
        )
    for n, t in enumerate(report["incidents"]):
        i, f = t["incident"], t["figures"]
        body.append(f"<h2 id='incident-{i['id']}'>{esc(_title(t))}</h2>")
        meta = f"severity {esc(i['severity'])} · opened {clock(i['opened_at'])} by {esc(i['opened_by'])}"
        if i["closed_at"]:
            meta += f" · closed {clock(i['closed_at'])} by {esc(str(i['closed_by']))}"
        body.append(
            f"<p class='muted'>{meta} · ranks {esc(', '.join(map(str, i['ranks'])) or '-')} · nodes {esc(', '.join(i['nodes']) or '-')}</p>"
        )
        if i.get("summary"):
            body.append(f"<blockquote>{esc(i['summary'])}</blockquote>")
        if f.get("fault"):
            body.append(f"<p><b>Fault</b>: {esc(f['fault'])} at {clock(f['fault_at'])}</p>")
        body.append(
            "<div class='figs'>"
            + "".join(
                f"<div class='fig'>{esc(label)}<b>{esc(value)}</b></div>"
                for label, value in figure_lines(f)
            )
            + "</div>"
        )
        if "charts" in t:
            body.append(_chart(t, f"chart-{n}"))
        rows = []
        for e in t["entries"]:
            links = []
            if e.get("runbook_url"):
                links.append(f"<a href='{esc(e['runbook_url'])}'>runbook</a>")
            if e.get("ui_url"):
                links.append(f"<a href='{esc(e['ui_url'])}'>open</a>")
            rows.append(
                f"<tr class='entry sev-{esc(e['severity'])}' data-source='{esc(e['source'])}' data-kind='{esc(e['kind'])}'>"
                f"<td>{clock(e['at'])[11:23]}</td><td>{'' if e['step'] is None else e['step']}</td>"
                f"<td>{esc(e['source'])}/{esc(e['kind'])}</td><td>{esc(_where(e))}</td><td>{esc(e['severity'])}</td>"
                f"<td>{esc(e['text'])}</td><td>{' '.join(links)}</td></tr>"
            )
        body.append(
            "<h3>Timeline</h3><table class='timeline'><thead><tr><th>Time (UTC)</th><th>Step</th>"
            "<th>Source</th><th>Rank / node</th><th>Severity</th><th>What</th><th>Links</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>"
        )
    if report["notes"]:
        body.append(
            "<h2>Logbook</h2><ul>"
            + "".join(
                f"<li><code>{clock(n['at'])}</code> <b>{esc(n['author'])}</b>: {esc(n['text'])}</li>"
                for n in report["notes"]
            )
            + "</ul>"
        )
    if report["incidents"]:
        body.append(
            "<h3>How the figures are computed</h3><ul>"
            + "".join(
                f"<li><code>{esc(k)}</code>: {esc(v)}</li>"
                for k, v in report["definitions"].items()
            )
            + "</ul>"
        )
    script = f"<script>{get_plotlyjs()}</script>" if report["incidents"] else ""
    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>Post-mortem: {esc(run['name'])}</title>"
        f"<style>{CSS}</style>{script}</head><body>{''.join(body)}</body></html>\n"
    )


def render(report: dict[str, Any], fmt: str) -> str:
    if fmt == "md":
        return render_markdown(report)
    if fmt == "html":
        return render_html(report)
    if fmt == "json":
        return render_json(report)
    raise ValueError(f"format {fmt!r}: use md, html or json")


# -- posting -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PostOutcome:
    ok: bool
    status: int | None
    error: str | None

    def describe(self) -> str:
        if self.ok:
            return f"posted (HTTP {self.status})"
        if self.status is not None:
            return f"HTTP {self.status}" + (f": {self.error}" if self.error else "")
        return str(self.error)


def post_kind(url: str, kind: str = "auto") -> str:
    if kind != "auto":
        return kind
    return "slack" if "slack" in url.lower() else "webhook"


def payload(report: dict[str, Any], kind: str) -> dict[str, Any]:
    """Slack-compatible: ``{"text": mrkdwn}``. Generic webhook: the Markdown as ``text``
    and the report (without chart data) as ``report``."""
    if kind == "slack":
        return {"text": render_markdown(report, flavor="slack")}
    slim = {
        **report,
        "incidents": [{k: v for k, v in t.items() if k != "charts"} for t in report["incidents"]],
    }
    return {"text": render_markdown(report), "report": slim}


def post_report(
    report: dict[str, Any], url: str, *, kind: str = "auto", timeout_s: float = 10.0
) -> PostOutcome:
    """POST the report to ``url``; never raises: the outcome says what happened."""
    import httpx  # httpx: only a report that is posted needs a client

    try:
        body = json.dumps(payload(report, post_kind(url, kind)), default=str)
        response = httpx.post(
            url, content=body, headers={"Content-Type": "application/json"}, timeout=timeout_s
        )
    except httpx.HTTPError as exc:
        return PostOutcome(False, None, f"{type(exc).__name__}: {exc}")
    if response.is_success:
        return PostOutcome(True, response.status_code, None)
    return PostOutcome(False, response.status_code, response.text.strip().replace("\n", " ")[:200])
