"""Replica agreement on the Ranks page: one strip per replica group, a cell per checked
step, drawn by a pure function of the collector's comparisons
(``GET /api/v1/runs/{run}/replicas``, ``read.replicas.results``).

A cell is green when the group's fingerprints agreed, red when a rank left the majority
(its title names the suspects) or, on a probed step, when a rank's determinism probe did
while the parameters agreed, and marked when members sent none (left out, not
suspects). A suspect stands out: the strip's line names every suspect rank and the step
each was first found at.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from dash import html

MAX_CELLS = 60  # checks a strip shows: the newest
MAX_STRIPS = 16  # replica groups drawn; the rest counted in one line


def _cell(r: dict[str, Any]) -> html.Span:
    probe = r.get("probe_suspects") or []
    if r["suspects"]:
        kind, title = "rep-bad", f"step {r['step']}: suspects {r['suspects']}"
        if probe:
            title += f"; probe suspects {probe}"
    elif probe:
        kind = "rep-bad"
        title = f"step {r['step']}: parameters agree; probe suspects {probe} (compute differently)"
    elif r["missing"]:
        kind, title = "rep-partial", f"step {r['step']}: agreed; no fingerprint from {r['missing']}"
    else:
        kind, title = "rep-ok", f"step {r['step']}: {r['fingerprints']} replicas agree"
    data: dict[str, Any] = {"data-step": str(r["step"])}  # Dash's data-* props: a dict
    return html.Span(className=f"rep-cell {kind}", title=title, **data)


def _odd(r: dict[str, Any]) -> bool:
    return bool(r["suspects"] or r.get("probe_suspects"))


def strips(results: Iterable[dict[str, Any]]) -> html.Div | None:
    """The section, or None when the run has no replica checks."""
    by_group: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_group[r["replica_group"]].append(r)
    if not by_group:
        return None
    rows = []
    groups = sorted(by_group, key=lambda g: (not any(map(_odd, by_group[g])), g))
    for group in groups[:MAX_STRIPS]:
        checks = sorted(by_group[group], key=lambda r: r["step"])[-MAX_CELLS:]
        first: dict[int, int] = {}
        first_probe: dict[int, int] = {}
        for r in checks:
            for rank in r["suspects"]:
                first.setdefault(rank, r["step"])
            for rank in r.get("probe_suspects") or ():
                first_probe.setdefault(rank, r["step"])
        named = [f"rank {rank} (from step {step})" for rank, step in sorted(first.items())]
        named += [
            f"rank {rank} (its probe, from step {step})"
            for rank, step in sorted(first_probe.items())
        ]
        said = "suspects: " + ", ".join(named) if named else f"{len(checks)} checks, all agree"
        data: dict[str, Any] = {"data-group": group}
        rows.append(
            html.Div(
                [
                    html.Span(f"ranks {group}", className="rep-group"),
                    html.Span([_cell(r) for r in checks], className="rep-strip"),
                    html.Span(said, className="rep-said rep-suspect" if named else "rep-said"),
                ],
                className="rep-row",
                **data,
            )
        )
    more = len(groups) - MAX_STRIPS
    return html.Div(
        [
            html.H3("Replica agreement"),
            html.P(
                "Each checked step's parameter fingerprints (and determinism probes, where "
                "on) within each replica group: green agreed, red a rank left the majority "
                "(silent data corruption suspect).",
                className="hint",
            ),
            *rows,
            *([html.P(f"… and {more} more replica groups")] if more > 0 else []),
        ],
        className="rep-section",
    )
