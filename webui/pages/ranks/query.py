"""The ranks page's URL, ``?rank=3&from=1200&to=1800&user=moe.load``: the rank whose
detail is shown, the step range the heatmaps are read for, the picked user metric; and
the URL after the clicks and zooms on the heatmaps."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlencode

from ...components import parse_user, user_param


def parse_query(search: str | None) -> tuple[int | None, int | None, int | None]:
    """``(rank, from_step, to_step)`` from ``?rank=3&from=100&to=200``; what is not a
    whole number is ignored (a hand-edited URL still shows the page)."""
    query = parse_qs((search or "").lstrip("?"))

    def number(key: str) -> int | None:
        text = (query.get(key) or [""])[0].strip()
        return int(text) if text.lstrip("-").isdigit() else None

    lo, hi = number("from"), number("to")
    if lo is not None and hi is not None and hi < lo:
        lo, hi = hi, lo
    return number("rank"), lo, hi


def query_string(
    rank: int | None, lo: int | None, hi: int | None, *, user: str | None = None
) -> str:
    shown = None if user is None else user_param(user)
    pairs = [
        (k, v)
        for k, v in (("rank", rank), ("from", lo), ("to", hi), ("user", shown))
        if v is not None
    ]
    return "?" + urlencode(pairs) if pairs else ""


def range_from_relayout(relayout: dict[str, Any] | None) -> tuple[int | None, int | None] | None:
    """The step range a zoom chose; ``(None, None)`` for a reset; None: not an x zoom."""
    if not relayout:
        return None
    if relayout.get("xaxis.autorange"):
        return None, None
    lo, hi = relayout.get("xaxis.range[0]"), relayout.get("xaxis.range[1]")
    if lo is None and isinstance(relayout.get("xaxis.range"), list):
        lo, hi = relayout["xaxis.range"]
    if lo is None or hi is None:
        return None
    return max(0, int(float(lo))), int(float(hi)) + 1


def clicked_rank(click: dict[str, Any] | None) -> int | None:
    try:
        return int(round(float(click["points"][0]["y"])))  # type: ignore[index]
    except (TypeError, KeyError, IndexError, ValueError):
        return None


def apply_gestures(
    search: str | None, stores: list[Any], applied: int | None
) -> tuple[str, int | None]:
    """The URL after the gestures in ``stores`` numbered above ``applied``, oldest first
    (a click sets the rank, a zoom the step range, a double-click drops it), and the
    number of the newest gesture applied."""
    rank, lo, hi = parse_query(search)
    last = applied
    gestures = [g for store in stores if store for g in store.get("list") or []]
    for gesture in sorted(gestures, key=lambda g: g.get("n", 0)):
        n = gesture.get("n")
        if not isinstance(n, int) or (applied is not None and n <= applied):
            continue
        last = n if last is None else max(last, n)
        if "rank" in gesture:
            picked = clicked_rank({"points": [{"y": gesture["rank"]}]})
            if picked is not None:
                rank = picked
        else:
            chosen = range_from_relayout(gesture.get("relayout"))
            if chosen is not None:
                lo, hi = chosen
    return query_string(rank, lo, hi, user=parse_user(search)), last
