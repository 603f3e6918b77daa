"""Which rank, which collective: the ranks page's Collectives section and the overview's
hang banner, as pure functions of the collector's hang view (``hang.view``, the same dict
as ``GET /api/v1/runs/{run}/collectives``).

When a job hangs every rank waits in some collective. The collector lines the ranks'
Flight Recorder rings up by sequence id per process group: the ranks that never issued
sequence k while others wait in k are the culprits, the waiting ones victims; ranks that
issued different sizes or ops at one sequence id are a desync. This module draws that
verdict, then a table per process group (the culprits first). A run may have thousands of
ranks: each table shows at most :data:`MAX_ROWS` of them and one line for the rest.

Times are UTC (``12:01:07``): the ranks, the collector and the reader may be in three
time zones, and the verdict's summary, written by the collector, speaks UTC too.
"""

from __future__ import annotations

import datetime as dt
import itertools
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote

from dash import dcc, html

from trainwarden.collector.ingest import endings

MAX_ROWS = 64  # a group's table; Dash renders each cell, and thousands take the browser minutes
MAX_GROUPS = 8  # process groups drawn as tables; the rest are counted in one line
MAX_LISTED = 8  # unusable rings, unavailable rings: the first ones, then a count
ANCHOR = "ranks-collectives"  # the section's id: the overview's banner links to it
READ = "ranks-coll-read"  # the read button's id: {"type": READ, "index": "top" | "bottom"}
QUIET = "No collectives read yet: they are read when a rank hangs."
ROLE_CLASS = {"culprit": "coll-culprit", "victim": "coll-victim"}
BANNER_KINDS = ("culprit", "desync")
TRIGGERS = {"command": "on request", "stalled": "on a stall"}


# -- small texts ---------------------------------------------------------------------


def utc(ts: float | None) -> str:
    """``HH:MM:SS`` in UTC; ``—`` for no time."""
    if ts is None:
        return "—"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%H:%M:%S")


def ranks_text(ranks: Iterable[int], *, pieces: int = 6) -> str:
    """``0–4, 6, 7``: runs of consecutive ranks as ranges, at most ``pieces`` of them
    (a victim list of 4,095 ranks is one line, not a page)."""
    ordered = sorted(set(ranks))
    spans = []
    for _, run in itertools.groupby(enumerate(ordered), lambda item: item[1] - item[0]):
        found = [r for _, r in run]
        if len(found) > 2:
            spans.append(f"{found[0]}–{found[-1]}")
        else:
            spans.extend(str(r) for r in found)
    if len(spans) <= pieces:
        return ", ".join(spans)
    return ", ".join(spans[:pieces]) + f", … ({len(ordered):,} ranks)"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def sizes_text(sizes: Sequence[Sequence[int]] | None, dtypes: Sequence[str] | None) -> str:
    """A collective's input tensors: ``1024×4 Float, 8 Half``; a 0-d tensor is ``scalar``."""
    sizes, dtypes = list(sizes or []), list(dtypes or [])
    if not sizes and not dtypes:
        return "—"
    parts = []
    for i in range(max(len(sizes), len(dtypes))):
        shape = sizes[i] if i < len(sizes) else None
        kind = dtypes[i] if i < len(dtypes) else ""
        dims = "?" if shape is None else "×".join(str(d) for d in shape) or "scalar"
        parts.append(f"{dims} {kind}".strip())
    return ", ".join(parts)


def _state_text(row: dict[str, Any]) -> str:
    if row.get("note"):
        return str(row["note"])
    if row.get("last_seq") is None:
        return "—"
    state = row.get("state") or "?"
    return f"{state} · {'done' if row.get('done') else 'not done'}"


def _group_label(group: dict[str, Any] | None) -> str:
    if not group:
        return ""
    desc = f"{group['desc']}, " if group.get("desc") else ""
    return f"pg {group.get('pg')} ({desc}{_plural(int(group.get('size') or 0), 'rank')})"


# -- the verdict ---------------------------------------------------------------------

_RANK = re.compile(r"\b(ranks? )(\d+)\b")


def _marked_summary(summary: str, culprits: Sequence[int]) -> list[Any]:
    """The collector's one line with each culprit's ``rank N`` in the culprit's colour."""
    out: list[Any] = []
    last = 0
    for found in _RANK.finditer(summary):
        if int(found.group(2)) not in culprits:
            continue
        out.append(summary[last : found.start()])
        out.append(html.Span(found.group(0), className="coll-culprit"))
        last = found.end()
    out.append(summary[last:])
    return [part for part in out if part != ""]


def _role_chips(verdict: dict[str, Any]) -> list[Any]:
    chips = []
    for key, word, css in (
        ("culprits", "culprit", "coll-culprit"),
        ("victims", "victim", "coll-victim"),
        ("dead", "dead", "coll-dead"),
        ("no_ring", "no ring", "coll-noring"),
    ):
        ranks = verdict.get(key) or []
        if not ranks:
            continue
        label = word if key in ("dead", "no_ring") else (word + ("s" if len(ranks) > 1 else ""))
        text = f"{label}: {'rank' if len(ranks) == 1 else 'ranks'} {ranks_text(ranks)}"
        chips.append(html.Span(text, className=f"coll-chip {css}"))
    return chips


def _unusable(unusable: dict[str, str] | None) -> Any:
    if not unusable:
        return None
    items = sorted(unusable.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0)
    lines = [html.Li(f"rank {rank}: {why}") for rank, why in items[:MAX_LISTED]]
    if len(items) > MAX_LISTED:
        lines.append(html.Li(f"… and {len(items) - MAX_LISTED:,} more"))
    return html.Div(
        [html.Span("Rings left out", className="fact-key"), html.Ul(lines, className="coll-list")],
        className="coll-unusable",
    )


def desync_part(desync: dict[str, Any] | None) -> Any:
    """The sides of a desync: which ranks issued what at the same sequence id."""
    if not desync:
        return None
    rows = [
        html.Tr(
            [
                html.Td(ranks_text(side.get("ranks") or [])),
                html.Td(side.get("op") or "—"),
                html.Td(sizes_text(side.get("sizes"), side.get("dtypes"))),
            ],
            className="coll-side",
        )
        for side in desync.get("sides") or []
    ]
    return html.Div(
        [
            html.P(
                f"Desync on pg {desync.get('pg')} at seq {desync.get('seq')}: the ranks "
                f"issued {len(rows)} different collectives there.",
                className="coll-desync-head",
            ),
            html.Table(
                [
                    html.Thead(html.Tr([html.Th(h) for h in ("Ranks", "Op", "Sizes and dtypes")])),
                    html.Tbody(rows),
                ],
                className="runs-table coll-table coll-desync",
            ),
        ]
    )


def verdict_part(verdict: dict[str, Any]) -> html.Div:
    """The collector's verdict: its summary (the culprit marked), who plays which role,
    where (group, seq, op), the rings it could not use, and a desync's sides."""
    kind = verdict.get("kind") or "none"
    culprits = list(verdict.get("culprits") or [])
    where = [
        part
        for part in (
            _group_label(verdict.get("group")),
            f"seq {verdict['seq']}" if verdict.get("seq") is not None else "",
            verdict.get("op") or "",
            sizes_text(verdict.get("sizes"), verdict.get("dtypes"))
            if verdict.get("sizes") or verdict.get("dtypes")
            else "",
        )
        if part
    ]
    chips = _role_chips(verdict)
    return html.Div(
        [
            html.P(
                _marked_summary(str(verdict.get("summary") or ""), culprits),
                className="coll-summary",
            ),
            html.Div(chips, className="coll-chips") if chips else None,
            html.P(" · ".join(where), className="hint") if where else None,
            desync_part(verdict.get("desync")),
            _unusable(verdict.get("unusable")),
        ],
        className=f"coll-verdict coll-verdict-{kind}",
        id="ranks-coll-verdict",
    )


# -- per process group ---------------------------------------------------------------


def row_order(row: dict[str, Any]) -> tuple[int, int]:
    """Culprits first, then by rank."""
    return (0 if row.get("role") == "culprit" else 1, int(row.get("rank") or 0))


def _more_line(hidden: Sequence[dict[str, Any]]) -> str:
    """``… and 4,032 more ranks at seq 4817``; by seq when they differ."""
    seqs = Counter(row.get("last_seq") for row in hidden)
    head = f"… and {_plural(len(hidden), 'more rank')}"
    if len(seqs) == 1:
        (seq,) = seqs
        return head + (" with no ring" if seq is None else f" at seq {seq}")
    parts = [
        f"{n:,} {'with no ring' if seq is None else f'at seq {seq}'}"
        for seq, n in seqs.most_common(3)
    ]
    if len(seqs) > 3:
        parts.append(f"{sum(n for _, n in seqs.most_common()[3:]):,} elsewhere")
    return f"{head}: " + ", ".join(parts)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


def group_part(group: dict[str, Any], *, named: bool = False) -> html.Div:
    """One process group's ranks: where each one's ring ends. ``named``: the group the
    verdict is about."""
    pg = str(group.get("pg"))
    rows = sorted(group.get("rows") or [], key=row_order)
    shown, hidden = rows[:MAX_ROWS], rows[MAX_ROWS:]
    body = []
    for row in shown:
        role = row.get("role")
        css = " ".join(c for c in ("coll-row", ROLE_CLASS.get(role or "")) if c)
        # data-* attributes: a test (or a user's script) finds a rank's row by them.
        data: dict[str, Any] = {"data-rank": str(row.get("rank")), "data-pg": pg}
        body.append(
            html.Tr(
                [
                    html.Td(str(row.get("rank"))),
                    html.Td(row.get("node") or "—"),
                    html.Td("—" if row.get("last_seq") is None else str(row["last_seq"])),
                    html.Td(row.get("op") or "—"),
                    html.Td(sizes_text(row.get("in_sizes"), row.get("in_dtypes"))),
                    html.Td(_state_text(row), className="detail" if row.get("note") else None),
                    html.Td(utc(row.get("since"))),
                    html.Td(role or ""),
                ],
                className=css,
                id=f"ranks-coll-{_safe(pg)}-{row.get('rank')}",
                **data,
            )
        )
    desc = f" · {group['desc']}" if group.get("desc") else ""
    size = len(group.get("ranks") or []) or len(rows)
    title = f"pg {pg}{desc} · {_plural(size, 'rank')}" + (" · the verdict's group" if named else "")
    head = ("Rank", "Node", "Last seq", "Op", "Sizes and dtypes", "State", "Since (UTC)", "Role")
    return html.Div(
        [
            html.H4(title, className="coll-group-title"),
            html.Table(
                [html.Thead(html.Tr([html.Th(h) for h in head])), html.Tbody(body)],
                className="runs-table coll-table",
            )
            if body
            else html.P("No ring of this group's ranks yet.", className="hint"),
            html.P(_more_line(hidden), className="hint coll-more") if hidden else None,
        ],
        className="coll-group",
    )


def groups_part(groups: Sequence[dict[str, Any]], *, verdict: dict[str, Any] | None) -> list[Any]:
    """The verdict's group first, then groups with a culprit, then the rest by pg; past
    :data:`MAX_GROUPS` groups (a run of 4,096 ranks may have 512 tensor-parallel groups)
    one line counts the rest."""
    named = str(((verdict or {}).get("group") or {}).get("pg"))

    def order(group: dict[str, Any]) -> tuple[int, int, str]:
        pg = str(group.get("pg"))
        culprit = any(r.get("role") == "culprit" for r in group.get("rows") or [])
        return (0 if pg == named else 1, 0 if culprit else 1, pg.zfill(12))

    ordered = sorted(groups, key=order)
    parts: list[Any] = [
        group_part(g, named=str(g.get("pg")) == named) for g in ordered[:MAX_GROUPS]
    ]
    if len(ordered) > MAX_GROUPS:
        rest = ordered[MAX_GROUPS:]
        parts.append(
            html.P(
                f"… and {_plural(len(rest), 'more process group')} "
                f"(pg {', '.join(str(g.get('pg')) for g in rest[:5])}"
                f"{', …' if len(rest) > 5 else ''}), none the verdict's.",
                className="hint coll-more",
            )
        )
    return parts


# -- the rings and the section -------------------------------------------------------


def rings_part(view: dict[str, Any]) -> html.P | None:
    """Whose rings the collector has, when they were read, and why some are missing."""
    rings: dict[str, dict[str, Any]] = view.get("rings") or {}
    requested = view.get("requested_at")
    asked = f"Asked the ranks at {utc(requested)} UTC. " if requested else ""
    if not rings:
        return html.P(asked + "Waiting for their rings.", className="hint") if asked else None
    usable = [r for r in rings.values() if r.get("available", True)]
    newest = max((r.get("at") or 0.0 for r in rings.values()), default=None)
    how = Counter(TRIGGERS.get(str(r.get("trigger")), str(r.get("trigger"))) for r in usable)
    text = f"Rings from {_plural(len(usable), 'rank')}"
    if how:
        text += " (" + ", ".join(f"{n:,} {why}" for why, n in how.most_common()) + ")"
    text += f", newest read {utc(newest)} UTC. " + asked
    missing = sorted(
        (
            (int(rank) if str(rank).isdigit() else 0, r.get("reason") or "no reason given")
            for rank, r in rings.items()
            if not r.get("available", True)
        ),
    )
    if missing:
        listed = "; ".join(f"rank {rank}: {why}" for rank, why in missing[:MAX_LISTED])
        more = f"; and {len(missing) - MAX_LISTED:,} more" if len(missing) > MAX_LISTED else ""
        text += f"No ring from {_plural(len(missing), 'rank')}: {listed}{more}."
    return html.P(text.strip(), className="hint coll-rings")


def has_data(view: dict[str, Any] | None) -> bool:
    """Whether there is anything to draw: a verdict, or rings."""
    return bool(view and (view.get("verdict") or view.get("rings")))


def _read_button(label: str, where: str) -> html.Button:
    return html.Button(
        label, id={"type": READ, "index": where}, className="btn btn-small", n_clicks=0
    )


def section(view: dict[str, Any], *, may_change: bool, where: str = "top") -> list[Any] | None:
    """The Collectives section, once the collector has rings: the verdict and a table
    per process group; None before (:func:`quiet_line`). ``may_change``: the session may
    ask the ranks for their rings again (the button is shown); ``where`` it is drawn."""
    if not has_data(view):
        return None
    verdict = view.get("verdict")
    again = _read_button("Read collectives again", where) if may_change else None
    return [
        html.H3("Collectives", className="coll-title"),
        verdict_part(verdict) if verdict else None,
        html.Div([rings_part(view), again], className="coll-toolbar"),
        *groups_part(view.get("groups") or [], verdict=verdict),
    ]


def quiet_line(view: dict[str, Any], *, may_change: bool, where: str = "bottom") -> Any:
    """One quiet line while no rank has sent a ring (None once one has), with a button
    for a session that may ask the ranks for theirs."""
    if has_data(view):
        return None
    button = _read_button("Read collectives now", where) if may_change else None
    return html.Div(
        [
            html.Span("Collectives", className="fact-key"),
            html.Span(QUIET, className="hint"),
            button,
            rings_part(view),
        ],
        className="coll-quiet",
    )


def on_top(view: dict[str, Any], *, hung: int) -> bool:
    """Whether the collectives go above the rank states: while ranks are hung (the hang
    is live, whatever the rings say yet), or when the verdict names a culprit or a
    desync. Else they go to the bottom of the page: rings of a hang long over, or none,
    must not push the heatmaps down on a run that is fine."""
    kind = (view.get("verdict") or {}).get("kind")
    return hung > 0 or kind in BANNER_KINDS


def placed(view: dict[str, Any], *, hung: int, may_change: bool) -> tuple[Any, Any]:
    """(what goes above the rank states, what goes at the bottom of the page): the
    section, or the quiet line, in one of the two (:func:`on_top`); None in the other."""
    where = "top" if on_top(view, hung=hung) else "bottom"
    drawn = section(view, may_change=may_change, where=where) or quiet_line(
        view, may_change=may_change, where=where
    )
    return (drawn, None) if where == "top" else (None, drawn)


# -- the overview's banner -----------------------------------------------------------


def banner(view: dict[str, Any] | None, *, run: str, hung: int) -> html.Div | None:
    """One line for the top of the run's overview: the verdict's summary and a link to
    the ranks page's Collectives section. Only while ``hung`` ranks remain (the health
    evaluator's state, which clears when steps complete again) and the verdict names a
    culprit or a desync."""
    verdict = (view or {}).get("verdict")
    if not hung or not verdict or verdict.get("kind") not in BANNER_KINDS:
        return None
    label = "Hang: " if verdict["kind"] == "culprit" else "Desync: "
    href = f"/runs/{quote(run, safe='')}/ranks#{ANCHOR}"
    return html.Div(
        [
            html.Strong(label),
            *_marked_summary(str(verdict.get("summary") or ""), verdict.get("culprits") or []),
            " · ",
            dcc.Link("which rank, which collective", href=href, className="coll-banner-link"),
        ],
        className="notice notice-error coll-banner",
        id="run-hang-banner",
        role="alert",
    )


def lost_banner(run: Any) -> html.Div | None:
    """The story of a job that died in a collective, for the top of its overview once no
    rank is hung any more: the verdict (who, which collective, which group, since when)
    and how the job ended, from the ranks' own states (a rank keeps its place in the
    verdict when it dies or is torn down)."""
    placed = [
        r
        for r in run.ranks
        if r.state in ("failed", "dead")
        and (r.state_detail or {}).get("collective")
        and (r.state_detail or {}).get("role") in ("culprit", "victim")
    ]
    if not placed:
        return None
    ended = {(r.state_detail or {}).get("ended") if r.state == "failed" else None for r in placed}
    how = next(endings.HOW[e] for e in ("sigterm", "stopped", None, "exception") if e in ended)
    detail = placed[0].state_detail or {}
    culprits = [r.rank for r in placed if (r.state_detail or {}).get("role") == "culprit"]
    href = f"/runs/{quote(run.name, safe='')}/ranks#{ANCHOR}"
    return html.Div(
        [
            html.Strong("Job lost in a collective: "),
            *_marked_summary(str(detail.get("collective")), culprits),
            f"; the job was {how} (run {run.status})",
            " · ",
            dcc.Link("which rank, which collective", href=href, className="coll-banner-link"),
        ],
        className="notice notice-error coll-banner",
        id="run-hang-banner",
        role="alert",
    )


__all__ = [
    "MAX_ROWS",
    "banner",
    "lost_banner",
    "desync_part",
    "group_part",
    "has_data",
    "on_top",
    "placed",
    "quiet_line",
    "ranks_text",
    "section",
    "sizes_text",
    "utc",
    "verdict_part",
]
