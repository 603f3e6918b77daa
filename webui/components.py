"""Small pieces every page uses: times people read at a glance, and notices."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote

import dash
from dash import dcc, html
from plotly.io.json import to_json_plotly

from trainwarden.agent import metric_catalog as catalog

if TYPE_CHECKING:
    from .client import Client


def _span(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


def ago(ts: float, now: float | None = None) -> str:
    """``"12s ago"``, ``"5 min ago"``; past 90 minutes, the date and time."""
    seconds = max(0.0, (time.time() if now is None else now) - ts)
    if seconds < 5400:
        return f"{_span(seconds)} ago"
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def until(ts: float, now: float | None = None) -> str:
    """``"in 58 min"``, or ``"ended"``."""
    seconds = ts - (time.time() if now is None else now)
    return f"in {_span(seconds)}" if seconds > 0 else "ended"


def live_ago(ts: float, now: float) -> html.Span:
    """:func:`ago` that goes on counting in the browser (``assets/ages.js``) between
    refreshes; :func:`digest` leaves its text out, so a table is not redrawn (its buttons
    replaced under the pointer) only because a second passed."""
    times: dict[str, Any] = {"data-ago": ts, "data-now": now}
    return html.Span(ago(ts, now), className="ago", **times)


def live_until(ts: float, now: float) -> html.Span:
    """:func:`until`, counting down in the browser like :func:`live_ago`."""
    times: dict[str, Any] = {"data-until": ts, "data-now": now}
    return html.Span(until(ts, now), className="until", **times)


_LIVE = ("data-ago", "data-until")


def _still(node: Any) -> Any:
    """``node`` (a component's JSON) less the texts and clocks of its live times."""
    if isinstance(node, list):
        return [_still(n) for n in node]
    if not isinstance(node, dict):
        return node
    props = node.get("props")
    if isinstance(props, dict) and any(k in props for k in _LIVE):
        return {**node, "props": {k: v for k, v in props.items() if k in _LIVE}}
    return {k: _still(v) for k, v in node.items()}


def digest(part: Any) -> str:
    """A hash of what a refresh would draw, equal when only the clock moved: the live
    relative times (:func:`live_ago`, :func:`live_until`) count on in the browser."""
    drawn = to_json_plotly(part)
    if any(f'"{k}"' in drawn for k in _LIVE):
        drawn = json.dumps(_still(json.loads(drawn)), sort_keys=True)
    return hashlib.sha1(drawn.encode()).hexdigest()


def redraw(parts: Sequence[Any], seen: Sequence[str] | None) -> tuple[list[Any], list[str]]:
    """The parts to send, ``no_update`` for each drawn as it is already, and their digests
    (a page's store keeps them for the next refresh)."""
    digests = [digest(p) for p in parts]
    before: list[str | None] = list(seen or [])
    if len(before) != len(digests):  # a first refresh, or another page's store
        before = [None] * len(digests)
    out = [
        dash.no_update if old == d else part
        for part, d, old in zip(parts, digests, before, strict=True)
    ]
    return out, digests


def clock(ts: float, now: float | None = None) -> str:
    """The local time of day; with the date when it is not today."""
    when = dt.datetime.fromtimestamp(ts)
    today = dt.datetime.fromtimestamp(time.time() if now is None else now).date()
    return when.strftime("%H:%M:%S" if when.date() == today else "%Y-%m-%d %H:%M")


def notice(text: str, kind: str = "info") -> html.Div:
    return html.Div(text, className=f"notice notice-{kind}")


def field(label: str, control: Any, *, wide: bool = False) -> html.Label:
    """A form's control with its label above it (the alerts and timeline pages' forms)."""
    return html.Label(
        [html.Span(label, className="field-label"), control],
        className="field field-wide" if wide else "field",
    )


RUN_TABS = (
    ("Overview", ""),
    ("Ranks", "/ranks"),
    ("Hardware", "/hardware"),
    ("Timeline", "/timeline"),
    ("Run", "/info"),
)


def run_tabs(name: str, active: str) -> html.Nav:
    """The links between a run's pages; ``active`` is the shown tab's label."""
    base = f"/runs/{quote(name, safe='')}"
    links = [
        dcc.Link(
            label, href=base + suffix, className="tab tab-active" if label == active else "tab"
        )
        for label, suffix in RUN_TABS
    ]
    links.append(dcc.Link("Alerts", href=f"/alerts?run={quote(name, safe='')}", className="tab"))
    return html.Nav(links, className="run-tabs")


def is_default_pick(
    value: str | None, options: list[dict[str, str]] | None, picked: str | None
) -> bool:
    """Whether the picker shows the default (the first metric, no pick in the URL): a
    refresh setting it must not write ``user=`` into the address."""
    return picked is None and bool(options) and value == options[0]["value"]  # type: ignore[index]


def parse_user(search: str | None) -> str | None:
    """The metric picked in ``?user=``: a built-in extra by its name (``lr``), else a user
    metric as its series (``?user=moe.load`` is ``user.moe.load``)."""
    found = (parse_qs((search or "").lstrip("?")).get("user") or [""])[0].strip()
    if not found:
        return None
    return found if found in catalog.EXTRAS else "user." + found.removeprefix("user.")


def user_param(metric: str) -> str:
    """A picked metric as ``?user=`` writes it (:func:`parse_user` reads it back): a user
    metric's own name, or its series where that is a built-in's name (``user.lr``)."""
    short = metric.removeprefix("user.")
    return metric if metric in catalog.EXTRAS or short in catalog.EXTRAS else short


def metric_label(metric: str) -> str:
    """How a picked metric is named on the page: a built-in's label, a user metric's name."""
    found = catalog.METRIC.get(metric)
    return found.label if found is not None else metric.removeprefix("user.")


def user_choices(
    client: Client, name: str, picked: str | None
) -> tuple[list[dict[str, str]], str | None]:
    """(a metric picker's options, its value): the run's built-in extras and its own
    metrics; ``picked`` (the URL's) when the run has it, else the first, a default the URL
    does not get (:func:`is_default_pick`)."""
    found = client.extra_metrics(name)
    options = [{"label": metric_label(m), "value": m} for m in found]
    return options, picked if picked in found else (found[0] if found else None)
