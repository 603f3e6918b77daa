"""A post-mortem report as one self-contained HTML page, with its charts (plotly.js
inlined, so it opens with no network)."""

from __future__ import annotations

import html
from datetime import datetime, timezone
from typing import Any

from trainwarden.collector.incidents.report_format import (
    CHART_METRICS,
    MFU_FORMAT,
    clock,
    crash_lines,
    figure_lines,
    goodput_line,
    title_of,
    where_of,
)

CSS = (
    "\n"
    "body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;"
    "max-width:1200px;color:#1d232b;padding:0 1rem}\n"
    "h1{font-size:1.6rem}h2{margin-top:2.5rem;border-bottom:1px solid #ccd;padding-bottom:.3rem}\n"
    "table{border-collapse:collapse;width:100%;font-size:.88rem}"
    "td,th{border-bottom:1px solid #e3e6ea;padding:.3rem .5rem;text-align:left;"
    "vertical-align:top}\n"
    "th{background:#f4f6f8}.sev-critical{color:#b00020;font-weight:600}"
    ".sev-warning{color:#a15c00}\n"
    ".figs{display:grid;grid-template-columns:repeat(auto-fill,minmax(210px,1fr));gap:.6rem;"
    "margin:1rem 0}\n"
    ".fig{border:1px solid #dde;border-radius:6px;padding:.5rem .8rem}"
    ".fig b{display:block;font-size:1.2rem}\n"
    ".muted{color:#667}code{font-size:.85rem}"
    ".none{padding:2rem;border:1px dashed #aab;border-radius:6px}\n"
)


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
        *(
            [f"<p id='story'><b>How the job ended</b>: {esc(report['story'])}</p>"]
            if report.get("story")
            else []
        ),
        f"<p class='muted'>{len(report['incidents'])} incident(s) · world size "
        f"{run['world_size']} · "
        f"run {esc(str(run['status']))}, last step {run['last_step']} · generated "
        f"{clock(report['generated_at'], ms=False)}</p>",
    ]
    if good := goodput_line(report.get("goodput")):
        body.append(f"<p id='goodput'><b>Goodput</b>: {esc(good)}</p>")
    if not report["incidents"]:
        body.append(
            "<p class='none' id='no-incidents'>No incidents: no alert of this run fired and "
            "nobody opened one.</p>"
        )
    for n, t in enumerate(report["incidents"]):
        i, f = t["incident"], t["figures"]
        body.append(f"<h2 id='incident-{i['id']}'>{esc(title_of(t))}</h2>")
        meta = (
            f"severity {esc(i['severity'])} · opened {clock(i['opened_at'])} by "
            f"{esc(i['opened_by'])}"
        )
        if i["closed_at"]:
            meta += f" · closed {clock(i['closed_at'])} by {esc(str(i['closed_by']))}"
        body.append(
            f"<p class='muted'>{meta} · ranks {esc(', '.join(map(str, i['ranks'])) or '-')} "
            f"· nodes {esc(', '.join(i['nodes']) or '-')}</p>"
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
                f"<tr class='entry sev-{esc(e['severity'])}' "
                f"data-source='{esc(e['source'])}' data-kind='{esc(e['kind'])}'>"
                f"<td>{clock(e['at'])[11:23]}</td><td>{'' if e['step'] is None else e['step']}</td>"
                f"<td>{esc(e['source'])}/{esc(e['kind'])}</td><td>{esc(where_of(e))}</td><td>{esc(e['severity'])}</td>"
                f"<td>{esc(e['text'])}</td><td>{' '.join(links)}</td></tr>"
            )
        body.append(
            "<h3>Timeline</h3><table class='timeline'><thead><tr><th>Time (UTC)</th><th>Step</th>"
            "<th>Source</th><th>Rank / "
            "node</th><th>Severity</th><th>What</th><th>Links</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>"
        )
    if report.get("crashes"):
        body.append(
            "<h2 id='crashes'>Ranks that died of a signal</h2><ul>"
            + "".join(
                f"<li class='crash'><code>{clock(c['at'])}</code> {esc(c['summary'])}<pre>"
                + esc("\n".join(crash_lines(c)))
                + "</pre></li>"
                for c in report["crashes"]
            )
            + "</ul>"
        )
    if report.get("preflight"):
        pre = report["preflight"]
        body.append(
            f"<h2 id='preflight'>Preflight</h2><p>{esc(pre['summary'])}.</p><ul>"
            + "".join(
                f"<li>rank {f['rank']} ({esc(f['node'] or 'node unknown')}): "
                f"{esc('; '.join(f['reasons']))}</li>"
                for f in pre["failed"]
            )
            + "</ul>"
        )
    if report.get("nodes_elsewhere"):
        body.append(
            "<h2 id='nodes'>Nodes implicated in other runs</h2><ul>"
            + "".join(f"<li>{esc(n['summary'])}</li>" for n in report["nodes_elsewhere"])
            + "</ul>"
        )
    if report["notes"]:
        body.append(
            "<h2>Logbook</h2><ul>"
            + "".join(
                f"<li><code>{clock(n['at'])}</code> <b>{esc(n['author'])}</b>: "
                f"{esc(n['text'])}</li>"
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
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>Post-mortem: "
        f"{esc(run['name'])}</title>"
        f"<style>{CSS}</style>{script}</head><body>{''.join(body)}</body></html>\n"
    )
