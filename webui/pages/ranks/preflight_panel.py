"""Preflight on the Ranks page: a row a rank of its checks before step 0 (GEMM, memory
copy, all-reduce, faults) against the median rank, drawn by a pure function of
``GET /api/v1/runs/{run}/preflight`` (``read.preflight.results``). Nothing is drawn for a
run that ran none (``tw.init(preflight=True)``)."""

from __future__ import annotations

from typing import Any

from dash import html


def _rate(value: Any, unit: str, scale: float) -> str:
    return "—" if not isinstance(value, (int, float)) else f"{value / scale:,.1f} {unit}"


def _ratio(value: Any) -> str:
    return "—" if not isinstance(value, (int, float)) else f"{value:.2f}×"


def preflight_table(result: dict[str, Any]) -> Any:
    """The section, or None when the run's newest attempt ran no preflight."""
    ranks = result.get("ranks") or []
    if not ranks:
        return None
    failed = result.get("failed") or []
    simulated = any("simulated" in " ".join(r.get("faults") or []) for r in ranks)
    summary = (
        f"{len(failed)} of {len(ranks)} ranks failed preflight: {', '.join(map(str, failed))}"
        if failed
        else f"All {len(ranks)} ranks passed preflight"
    )
    header = html.Tr(
        [
            html.Th(h)
            for h in (
                "Rank",
                "Node",
                "Device",
                "GEMM",
                "× median",
                "Memory copy",
                "× median",
                "All-reduce",
                "Verdict",
            )
        ]
    )
    rows = []
    for r in ranks:
        ratios = r.get("ratios") or {}
        verdict = "; ".join(r.get("reasons") or []) if r.get("failed") else "passed"
        if r.get("error"):
            verdict = f"could not measure: {r['error']}"
        rows.append(
            html.Tr(
                [
                    html.Td(r["rank"]),
                    html.Td(r.get("node") or "—"),
                    html.Td(f"{r.get('device', '—')} ({r.get('dtype', '?')})"),
                    html.Td(_rate(r.get("gemm_flops"), "GFLOP/s", 1e9)),
                    html.Td(_ratio(ratios.get("gemm_flops"))),
                    html.Td(_rate(r.get("copy_bytes_per_s"), "GB/s", 1e9)),
                    html.Td(_ratio(ratios.get("copy_bytes_per_s"))),
                    html.Td(_rate(r.get("allreduce_bytes_per_s"), "GB/s", 1e9)),
                    html.Td(verdict),
                ],
                className="preflight-failed" if r.get("failed") else "preflight-passed",
            )
        )
    notes = [
        f"Before step 0 (attempt {result.get('attempt')}); a rank fails on a hard fault or "
        f"under {result.get('outlier', 0.85)}× the median rank. On a CPU the rates are per "
        "second of the rank's own CPU time, one thread."
    ]
    if simulated:
        notes.append("A fault marked simulated is a drill's stand-in (no GPU here).")
    return html.Div(
        [
            html.H3("Preflight"),
            html.P(summary, className="preflight-summary"),
            html.Table([html.Thead(header), html.Tbody(rows)], className="preflight-table"),
            *[html.P(n, className="hint") for n in notes],
        ],
        className="preflight-section",
    )
