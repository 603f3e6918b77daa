"""What the ranks page's button does through the client: “Read collectives now” asks
every rank of the run for its Flight Recorder ring."""

from __future__ import annotations

from ...client import Client, Refused


def read_collectives(client: Client, name: str) -> tuple[str, str]:
    """Ask every rank of the run for its collectives; (message, notice kind)."""
    try:
        asked = client.request_collectives(name, by="ui")
    except Refused as exc:
        return f"Not asked: {exc}.", "error"
    ranks = asked.get("ranks")
    who = "its ranks"
    if isinstance(ranks, int):
        who = "its only rank" if ranks == 1 else f"its {ranks:,} ranks"
    return (
        f"Asked {who} for their collectives: each answers with its next report (a few "
        "seconds; a rank whose process is gone never does, and is named so).",
        "info",
    )
