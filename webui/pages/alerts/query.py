"""The alerts page's URL, ``/alerts?run=r1&state=firing``: the run and the states its
filters show (the open ones when it names none)."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qs, urlencode

STATES = ("pending", "firing", "resolved")
OPEN = ["pending", "firing"]  # what /alerts shows when its URL names no state


def parse_query(search: str | None) -> tuple[str | None, list[str]]:
    """``?run=r1&state=firing`` (``state`` repeated or comma-separated) → (run, states)."""
    query = parse_qs((search or "").lstrip("?"))
    run = (query.get("run") or [""])[0].strip() or None
    if "state" not in query:
        return run, list(OPEN)
    asked = {s.strip() for value in query["state"] for s in value.split(",")}
    return run, [s for s in STATES if s in asked]  # ``state=none``: none ticked


def query_string(run: str | None, states: Sequence[str]) -> str:
    """The inverse of :func:`parse_query`; the default states are left out."""
    params = [("run", run)] if run else []
    if sorted(states) != sorted(OPEN):
        params += [("state", s) for s in STATES if s in states] or [("state", "none")]
    return f"?{urlencode(params)}" if params else ""
