"""A post-mortem report as text: the formatting of its times, durations, figures and
goodput, and the Markdown (GitHub or Slack flavour) and JSON renderings."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from trainwarden.collector.ingest import crashes

CRASH_FRAMES = 8
"""A crashed rank's innermost Python frames the report shows."""
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
        f"({g.get('interruptions', 0)} interruption(s), {g.get('replayed_steps', 0)} steps "
        "replayed); "
        f"GPU-hours used {hours.get('used', 0.0):.3f}, lost {hours.get('lost', 0.0):.3f}"
    )
    cost = g.get("cost")
    if cost is not None:
        line += (
            f"; cost {cost['used']:.2f} used, {cost['lost']:.2f} lost at "
            f"{g['price_per_gpu_hour']:g} per GPU-hour"
        )
    return line


def where_of(e: dict[str, Any]) -> str:
    parts = []
    if e.get("rank") is not None:
        parts.append(f"rank {e['rank']}")
    if e.get("node"):
        parts.append(str(e["node"]))
    return " ".join(parts)


def title_of(t: dict[str, Any]) -> str:
    i = t["incident"]
    return f"Incident {i['id']}: {i['title']} ({i['state']})"


def crash_report(c: dict[str, Any]) -> dict[str, Any]:
    """A ``rank_crashed`` event (with its rank, node, time and step) as the report keeps it:
    the headline, the cause or why none, the stack's innermost frames."""
    return {
        "rank": c.get("rank"),
        "node": c.get("node"),
        "at": c.get("at"),
        "step": c.get("step"),
        "signal": c.get("signal"),
        "collective": c.get("collective"),
        "summary": f"rank {c.get('rank')} {crashes.line(c)}",
        "cause": c.get("cause"),
        "cause_note": c.get("cause_note"),
        "stderr": c.get("stderr"),
        "stack": [
            f"{f.get('file')}:{f.get('line')} in {f.get('function')}"
            for f in (c.get("stack") or [])[:CRASH_FRAMES]
        ],
        "reported_by": (c.get("reported_by") or {}).get("rank"),
    }


def crash_lines(c: dict[str, Any]) -> list[str]:
    """A crash's lines under its headline: the cause or why none, the stack, the file."""
    lines = []
    if c.get("cause"):
        lines.append(f"cause: {c['cause']}")
    elif c.get("cause_note"):
        lines.append(f"no C++ message: {c['cause_note']}")
    if c.get("stderr"):
        lines.append(f"stderr: {c['stderr']}")
    lines += [f"at {frame}" for frame in c.get("stack") or ()]
    return lines


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
    if report.get("story"):
        lines += [f"{bold('How the job ended')}: {report['story']}", ""]
    lines.append(
        f"_{len(report['incidents'])} incident(s); world size {run['world_size']}; "
        f"run {run['status']}, last step {run['last_step']}; generated "
        f"{clock(report['generated_at'], ms=False)}_"
    )
    lines.append("")
    if good := goodput_line(report.get("goodput")):
        lines += [f"{bold('Goodput')}: {good}", ""]
    if not report["incidents"]:
        lines.append("No incidents: no alert of this run fired and nobody opened one.")
        lines.append("")
    for t in report["incidents"]:
        i, f = t["incident"], t["figures"]
        lines += [heading(title_of(t), 2), ""]
        scope = f"severity {i['severity']}; opened {clock(i['opened_at'])} by {i['opened_by']}"
        if i["closed_at"]:
            scope += f"; closed {clock(i['closed_at'])} by {i['closed_by']}"
        if i["ranks"] or i["nodes"]:
            scope += (
                f"; ranks {', '.join(map(str, i['ranks'])) or '-'}; nodes "
                f"{', '.join(i['nodes']) or '-'}"
            )
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
            where = where_of(e)
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
    if report.get("crashes"):
        lines += [heading("Ranks that died of a signal", 2), ""]
        for c in report["crashes"]:
            head = f"`{clock(c['at'])}` " + (
                f"step {c['step']} · " if c["step"] is not None else ""
            )
            lines.append(("• " if slack else "- ") + head + c["summary"].replace("\n", " "))
            lines += [f"  - {text}" for text in crash_lines(c)]
        lines.append("")
    if report.get("preflight"):
        pre = report["preflight"]
        lines += [heading("Preflight", 2), "", pre["summary"] + ".", ""]
        lines += [
            ("• " if slack else "- ")
            + f"rank {f['rank']} ({f['node'] or 'node unknown'}): {'; '.join(f['reasons'])}"
            for f in pre["failed"]
        ]
        lines.append("")
    if report.get("nodes_elsewhere"):
        lines += [heading("Nodes implicated in other runs", 2), ""]
        lines += [("• " if slack else "- ") + n["summary"] for n in report["nodes_elsewhere"]]
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


def render_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=False, default=str) + "\n"
