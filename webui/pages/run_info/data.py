"""What the run page reads through the client at each refresh, by component id, and
which of its parts changed since the last one; the diff with the run picked to compare."""

from __future__ import annotations

from typing import Any

import dash

from trainwarden.collector.read.queries import NotFound

from ...client import Client
from ...components import digest, notice
from . import data_panel
from .figures import breakdown_figure
from .panels import (
    attempts_table,
    checkpoints_section,
    diff_view,
    goodput_section,
    identity_section,
)

PARTS = ("ri-notice", "ri-identity", "ri-attempts", "ri-goodput", "ri-checkpoints", "ri-data")


def page_parts(client: Client, name: str, theme: str | None, *, now: float) -> dict[str, Any]:
    """Every part of the page by component id (``NotFound``: no such run)."""
    econ = client.economics(name)
    tries = client.attempts(name)
    ident = client.identity(name) if tries else None
    others = sorted(r.name for r in client.list_runs() if r.name != name)
    return {
        "ri-notice": None,
        "ri-identity": identity_section(ident),
        "ri-attempts": attempts_table(tries, now=now),
        "ri-goodput": goodput_section(econ["goodput"]),
        "ri-checkpoints": checkpoints_section(econ["checkpoints"], econ["advisor"]),
        "ri-data": data_panel.section(client.data(name), theme=theme, revision=name),
        "ri-breakdown.figure": breakdown_figure(econ["goodput"], theme=theme, revision=name),
        "ri-compare.options": others,
    }


def failed(message: str, theme: str | None, name: str) -> dict[str, Any]:
    return {
        "ri-notice": notice(message, "error"),
        **{part: None for part in PARTS[1:]},
        "ri-breakdown.figure": breakdown_figure(None, theme=theme, revision=name),
        "ri-compare.options": [],
    }


KEYS = (*PARTS, "ri-breakdown.figure", "ri-compare.options")


def changed(parts: dict[str, Any], seen: dict[str, str] | None) -> tuple[list[Any], dict[str, str]]:
    """The outputs in ``KEYS`` order, ``no_update`` for those drawn as they are already."""
    digests = {k: digest(parts[k]) for k in KEYS}
    seen = seen or {}
    return [dash.no_update if seen.get(k) == digests[k] else parts[k] for k in KEYS], digests


def diff_part(client: Client, name: str, other: str | None) -> Any:
    if not other:
        return None
    try:
        if not client.attempts(other):
            return notice(
                f"Run {other!r} has no identity (its agents are older than 0.11): "
                "nothing to compare."
            )
        return diff_view(client.diff(name, other))
    except NotFound:
        return notice(f"Run {other!r} not found any more; pick another.", "error")
