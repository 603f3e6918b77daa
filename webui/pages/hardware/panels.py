"""The hardware page's tables, as pure functions of GPU readings and events: every GPU's
newest reading by node (the hot, throttled and failing ones marked) and the XID errors
with their catalog meaning."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from dash import dcc, html

from trainwarden.agent.gpu import describe_xid
from trainwarden.collector.read.schemas import EventOut, GpuSample, RankInfo

HOT_C = 85.0  # where drivers start thermal slowdown on data-centre GPUs (H100: 87-90 C)
GPU_ROWS = 64  # past this many GPUs the table lists only those with something wrong
THROTTLE_HELP = {  # NVML clocks-event reasons, in the agent's names
    "sw_power_cap": "software power cap: drawing its power limit",
    "hw_slowdown": "hardware slowdown: power brake or overheating reported by the board",
    "sw_thermal": "software thermal slowdown: the GPU is too hot",
    "hw_thermal": "hardware thermal slowdown: the GPU is far too hot",
    "power_brake": "external power brake (the node's power supply)",
}


def finite(value: Any) -> float | None:
    """The reading as a number; None when it is missing, NaN or infinite."""
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def latest(samples: Iterable[GpuSample]) -> dict[int, GpuSample]:
    """The newest reading of each rank's GPU."""
    out: dict[int, GpuSample] = {}
    for s in samples:
        if s.rank not in out or s.ts >= out[s.rank].ts:
            out[s.rank] = s
    return out


def problems(s: GpuSample) -> list[str]:
    """What is wrong with this GPU now, in words; empty when nothing is."""
    found = []
    temp = finite(s.temp_c)
    if temp is not None and temp >= HOT_C:
        found.append(f"hot ({temp:.0f} °C)")
    if s.throttle:
        found.append("throttled: " + ", ".join(s.throttle))
    if s.ecc_uncorrected:
        found.append(f"{s.ecc_uncorrected} uncorrectable ECC errors")
    if s.retired_pages or s.remapped_rows_uncorrectable:
        found.append("retired memory pages / remapped rows")
    if s.remap_pending:
        found.append("row remap pending: reset the GPU")
    return found


def _num(value: Any, fmt: str, unit: str = "") -> str:
    v = finite(value)
    return "—" if v is None else f"{v:{fmt}}{unit}"


def _node(info: RankInfo | None) -> str:
    return (info.node or info.host or "unknown node") if info else "unknown node"


def xid_problems(xids: Iterable[XidRow]) -> dict[int, list[str]]:
    """Per rank, the XIDs its GPU reported that call for something (the catalog's action
    is not "nothing to do"), newest first: "XID 79 at 05:40:31: reboot the node"."""
    found: dict[int, list[str]] = {}
    for x in sorted(xids, key=lambda r: -r.ts):
        if x.rank is None or x.action == "ignore":
            continue
        when = dt.datetime.fromtimestamp(x.ts).strftime("%H:%M:%S")
        todo = ACTION_TEXT.get(x.action, x.action)
        found.setdefault(x.rank, []).append(
            f"XID {x.code} at {when}" + (f": {todo}" if todo else "")
        )
    return found


def gpu_table(
    run: str,
    samples: Sequence[GpuSample],
    ranks: Sequence[RankInfo],
    *,
    selected: int | None = None,
    xids: Sequence[XidRow] = (),
) -> html.Div:
    """The newest reading of every GPU, grouped by node; the hot, throttled and failing
    ones marked, and those whose GPU reported an XID that calls for action (a GPU off the
    bus may send no reading again). Past GPU_ROWS GPUs, only those with a problem are
    listed."""
    now = latest(samples)
    info = {r.rank: r for r in ranks}
    failed = xid_problems(xids)
    every = sorted(set(now) | set(info) | set(failed))
    if selected is not None:
        every = [r for r in every if r == selected]
    shown = (
        every
        if len(every) <= GPU_ROWS
        else [r for r in every if r in failed or (r in now and problems(now[r]))]
    )
    by_node: dict[str, list[int]] = {}
    for rank in shown:
        by_node.setdefault(_node(info.get(rank)), []).append(rank)
    base = f"/runs/{quote(run, safe='')}"
    rows: list[Any] = []
    for node in sorted(by_node):
        members = by_node[node]
        temps = [t for r in members if r in now and (t := finite(now[r].temp_c)) is not None]
        hottest = f" · hottest {max(temps):.0f} °C" if temps else ""
        rows.append(
            html.Tr(
                html.Td(
                    f"{node} · {len(members)} GPU{'s' if len(members) != 1 else ''}{hottest}",
                    colSpan=9,
                ),
                className="node-row",
            )
        )
        for rank in members:
            rows.append(_gpu_row(base, rank, now.get(rank), info.get(rank), failed.get(rank, [])))
    hidden = len(every) - len(shown)
    note = (
        html.P(
            f"{hidden} GPUs with nothing wrong are not listed; add ?rank=N to see one.",
            className="hint",
        )
        if hidden
        else None
    )
    head = (
        "Rank",
        "GPU",
        "Temperature",
        "Power / limit",
        "SM clock / max",
        "Throttle",
        "Util",
        "ECC corr. / uncorr.",
        "Problems",
    )
    table = html.Table(
        [html.Thead(html.Tr([html.Th(h) for h in head])), html.Tbody(rows)],
        className="runs-table gpu-table",
    )
    return html.Div([table, note])


def _gpu_row(
    base: str, rank: int, s: GpuSample | None, info: RankInfo | None, xids: list[str]
) -> html.Tr:
    link = dcc.Link(str(rank), href=f"{base}/ranks?rank={rank}", className="rank-link")
    if s is None:
        reason = (info.gpu or {}).get("reason") if info and info.gpu else None
        text = "; ".join([f"no GPU telemetry{': ' + str(reason) if reason else ''}", *xids])
        return html.Tr(
            [html.Td(link), html.Td(text, colSpan=8, className="detail")],
            id=f"hw-gpu-{rank}",
            className="gpu-bad" if xids else None,
        )
    temp = finite(s.temp_c)
    wrong = [*xids, *problems(s)]
    name = s.gpu_name or "GPU"
    if s.simulated and "simulated" not in name.lower():
        name += " (simulated)"
    memory = (
        f" (memory {_num(s.mem_temp_c, '.0f', ' °C')})" if finite(s.mem_temp_c) is not None else ""
    )
    throttle = [
        html.Span(t, className="mark mark-warn", title=THROTTLE_HELP.get(t, t))
        for t in s.throttle or []
    ]
    return html.Tr(
        [
            html.Td(link),
            html.Td([name, html.Div(s.gpu_uuid or "", className="detail")]),
            html.Td(
                _num(s.temp_c, ".0f", " °C") + memory,
                className="hot" if temp is not None and temp >= HOT_C else None,
            ),
            html.Td(f"{_num(s.power_w, '.0f')} / {_num(s.power_limit_w, '.0f', ' W')}"),
            html.Td(f"{_num(s.sm_clock_mhz, '.0f')} / {_num(s.sm_clock_max_mhz, '.0f', ' MHz')}"),
            html.Td(throttle or "—"),
            html.Td(_num(s.util_gpu, ".0f", " %")),
            html.Td(
                f"{s.ecc_corrected if s.ecc_corrected is not None else '—'} / "
                f"{s.ecc_uncorrected if s.ecc_uncorrected is not None else '—'}",
                className="hot" if s.ecc_uncorrected else None,
            ),
            html.Td("; ".join(wrong) or "ok", className="detail"),
        ],
        id=f"hw-gpu-{rank}",
        className="gpu-bad" if wrong else None,
    )


@dataclass(frozen=True)
class XidRow:
    ts: float
    rank: int | None
    node: str
    step: int | None
    code: int | None
    name: str
    meaning: str
    action: str
    simulated: bool


def xid_rows(events: Iterable[EventOut], ranks: Sequence[RankInfo]) -> list[XidRow]:
    """XID events, newest first, with their catalog meaning (from the event, or looked up
    in the catalog when an older agent sent only the code)."""
    info = {r.rank: r for r in ranks}
    out = []
    for e in events:
        if e.kind != "xid":
            continue
        d = e.data or {}
        code = d.get("code")
        known = describe_xid(int(code)) if isinstance(code, int) else {}
        out.append(
            XidRow(
                ts=e.ts,
                rank=e.rank,
                step=e.step,
                code=code if isinstance(code, int) else None,
                node=str(
                    d.get("node")
                    or d.get("host")
                    or _node(info.get(e.rank if e.rank is not None else -1))
                ),
                name=str(d.get("name") or known.get("name", "unknown XID")),
                meaning=str(d.get("meaning") or known.get("meaning", "")),
                action=str(d.get("action") or known.get("action", "")),
                simulated=bool(d.get("simulated")),
            )
        )
    return sorted(out, key=lambda r: -r.ts)


ACTION_TEXT = {
    "ignore": "nothing to do",
    "restart_app": "restart the application",
    "reset_gpu": "reset the GPU",
    "reboot_node": "reboot the node",
    "drain": "drain the node",
}


def xid_table(rows: Sequence[XidRow]) -> Any:
    if not rows:
        return html.P("No XID errors reported for this run.", className="hint")
    head = ("When", "Rank", "Node", "Step", "XID", "Meaning", "What to do")
    body = [
        html.Tr(
            [
                html.Td(dt.datetime.fromtimestamp(r.ts).strftime("%Y-%m-%d %H:%M:%S")),
                html.Td("—" if r.rank is None else r.rank),
                html.Td(r.node),
                html.Td("—" if r.step is None else r.step),
                html.Td([html.Strong(f"XID {r.code}"), html.Div(r.name, className="detail")]),
                html.Td(
                    [
                        r.meaning,
                        html.Span(" (simulated)", className="detail") if r.simulated else None,
                    ]
                ),
                html.Td(ACTION_TEXT.get(r.action, r.action)),
            ],
            className="xid-row",
        )
        for r in rows
    ]
    return html.Table(
        [html.Thead(html.Tr([html.Th(h) for h in head])), html.Tbody(body)],
        className="runs-table xid-table",
    )
