"""The timeline page's URL, ``?incident=3`` (the incident shown; the whole run without
it), and the links to the page and to the post-mortem downloads."""

from __future__ import annotations

from urllib.parse import parse_qs, quote


def parse_query(search: str | None) -> tuple[int | None, str | None]:
    """``?incident=3`` → (3, None); a value that is not an incident number → (None, what
    is wrong), so a hand-edited URL still shows the whole run's timeline."""
    values = parse_qs((search or "").lstrip("?")).get("incident") or [""]
    text = values[0].strip()
    if not text:
        return None, None
    if text.isdigit() and 1 <= int(text) <= 2**63 - 1:
        return int(text), None
    return None, f"“{text}” is not an incident number (?incident=3); showing the whole run."


def query_string(incident: int | None) -> str:
    return f"?incident={incident}" if incident is not None else ""


def page_href(run: str, incident: int | None = None) -> str:
    return f"/runs/{quote(run, safe='')}/timeline{query_string(incident)}"


def downloads_href(run: str, fmt: str, incident: int | None = None) -> str:
    """The post-mortem report as a file, served by the collector's API."""
    extra = f"&incident={incident}" if incident is not None else ""
    return f"/api/v1/runs/{quote(run, safe='')}/postmortem?format={fmt}{extra}&download=true"
