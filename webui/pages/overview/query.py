"""The overview's view in the URL's query string, ``?from=100&to=900&axis=time&rank=3``
(a range of steps, the step or time axis, a rank to draw; ``user=`` the picked metric of
the run's own), so a link opens what its sender saw; and the range a drag selects."""

from __future__ import annotations

import bisect
import datetime as dt
import math
import re
from typing import Any, Literal
from urllib.parse import parse_qs, urlencode

from ...components import parse_user, user_param

AXES = ("step", "time")


def parse_query(search: str | None) -> dict[str, Any]:
    """``?from=&to=&axis=&rank=`` as the view; what does not parse is left out."""
    q = parse_qs((search or "").lstrip("?"))

    def number(key: str) -> int | None:
        try:
            value = int(q[key][0])
        except (KeyError, ValueError):
            return None
        return value if value >= 0 else None

    lo, hi = number("from"), number("to")
    if lo is not None and hi is not None and hi < lo:
        lo, hi = hi, lo
    axis = q.get("axis", ["step"])[0]
    return {
        "from": lo,
        "to": hi,
        "axis": axis if axis in AXES else "step",
        "rank": number("rank"),
        "user": parse_user(search),
    }


def to_query(view: dict[str, Any]) -> str:
    """The view as a query string (``""`` for the default view)."""
    items = [(k, view[k]) for k in ("from", "to") if view.get(k) is not None]
    if view.get("axis", "step") != "step":
        items.append(("axis", view["axis"]))
    if view.get("rank") is not None:
        items.append(("rank", view["rank"]))
    if view.get("user"):
        items.append(("user", user_param(view["user"])))
    return "?" + urlencode(items) if items else ""


_RANGE_KEY = re.compile(r"xaxis\d*\.range(?:\[(\d)\])?$")


def range_from_relayout(
    relayout: dict[str, Any] | None, *, axis: str, xmap: dict[str, list[Any]] | None
) -> tuple[int, int] | None | Literal[False]:
    """The steps a zoom on the figure selected: ``(from, to)``; ``None`` for the whole
    run (a double-click autoscales); ``False`` when the event changed no x range."""
    if not relayout:
        return False
    if any(re.match(r"xaxis\d*\.autorange$", k) and v for k, v in relayout.items()):
        return None
    ends: dict[int, Any] = {}
    for key, value in relayout.items():
        found = _RANGE_KEY.match(key)
        if not found:
            continue
        if found.group(1) is None and isinstance(value, list) and len(value) == 2:
            ends = {0: value[0], 1: value[1]}
        else:
            ends[int(found.group(1))] = value
        if len(ends) == 2:
            break
    if len(ends) != 2:
        return False
    try:
        if axis == "time":
            t0, t1 = _timestamp(ends[0]), _timestamp(ends[1])
            steps, ts = (xmap or {}).get("step") or [], (xmap or {}).get("ts") or []
            if not steps:
                return False
            i = max(0, bisect.bisect_right(ts, t0) - 1)
            j = min(len(steps) - 1, bisect.bisect_left(ts, t1))
            lo, hi = steps[i], steps[j]
        else:
            lo, hi = math.floor(float(ends[0])), math.ceil(float(ends[1]))
    except (TypeError, ValueError, OverflowError):
        return False
    lo, hi = max(0, min(lo, hi)), max(0, max(lo, hi))
    return (lo, hi) if hi > lo else False


def _timestamp(value: Any) -> float:
    """A date on Plotly's time axis (``"2025-01-31 12:00:05.25"``, the server's local time)."""
    if isinstance(value, (int, float)):  # milliseconds since the epoch
        return float(value) / 1000.0
    text = str(value).replace("T", " ")
    whole, _, fraction = text.partition(".")
    parsed = dt.datetime.fromisoformat(whole)
    return parsed.timestamp() + (float(f"0.{fraction}") if fraction.isdigit() else 0.0)
