"""What the timeline page reads through the client at each refresh, and the parts it
draws of it (or says what is wrong instead)."""

from __future__ import annotations

from typing import Any

from ...charts import empty_figure, themed
from ...client import Client
from ...components import notice
from .figures import timeline_figure
from .panels import downloads, entries_table, figures_card, incident_header, incidents_list
from .query import parse_query

PARTS = ("tl-notice", "tl-incidents", "tl-header", "tl-downloads", "tl-figures", "tl-entries")
HIDDEN: dict[str, str] = {"display": "none"}  # the incident tools, until one is picked
SHOWN: dict[str, str] = {}


def page_parts(
    client: Client, name: str, search: str | None, theme: str | None, *, now: float
) -> tuple[Any, ...]:
    """(notice, incidents, header, downloads, figures, entries, chart, the incident tools'
    style, the close tools' style)."""
    wanted, problem = parse_query(search)
    incidents = client.incidents(name, merged=True)  # NotFound: no such run
    by_id = {i.id: i for i in incidents}
    said = [problem] if problem else []
    chosen = by_id.get(wanted) if wanted is not None else None
    if wanted is not None and chosen is None:
        said.append(
            f"Run {name!r} has no incident {wanted}; showing the whole run. "
            "Pick one of its incidents above."
        )
    elif chosen is not None and chosen.state == "merged" and chosen.merged_into in by_id:
        said.append(
            f"Incident {chosen.id} was merged into incident {chosen.merged_into}; showing that one."
        )
        chosen = by_id[chosen.merged_into]
    selected = chosen.id if chosen is not None else None
    tl = client.timeline(name, incident=selected)
    figures = tl.get("figures")
    origin = None
    if figures:
        origin = (
            figures.get("fault_at")
            if figures.get("fault_at") is not None
            else figures.get("pending_at")
        )
    listed = [i for i in incidents if i.state != "merged"]
    return (
        notice(" ".join(said), "error") if said else None,
        incidents_list(listed, run=name, selected=selected, now=now),
        incident_header(chosen, now=now),
        downloads(name, selected),
        figures_card(figures, tl.get("definitions") or {}) if chosen is not None else None,
        entries_table(tl["entries"], now=now, origin=origin),
        timeline_figure(tl["entries"], figures, theme=theme, revision=f"{name}:{selected}"),
        SHOWN if chosen is not None else HIDDEN,
        SHOWN if chosen is not None and chosen.state == "open" else HIDDEN,
    )


def failed(message: str, theme: str | None) -> tuple[Any, ...]:
    return (
        notice(message, "error"),
        None,
        None,
        None,
        None,
        None,
        themed(empty_figure("No timeline"), theme),
        HIDDEN,
        HIDDEN,
    )
