"""What the timeline page's buttons do, through the client to the API's own route
functions: add a note to the logbook, retitle or close the incident shown."""

from __future__ import annotations

from ...client import Client, Refused

BUTTONS = ("tl-note-add", "tl-retitle", "tl-close")


def perform(
    client: Client,
    button: str,
    *,
    run: str,
    incident: int | None,
    by: str | None,
    text: str | None = None,
    title: str | None = None,
    summary: str | None = None,
) -> tuple[str, str]:
    """Do what the pressed button says; returns (message, notice kind) for the page."""
    who = (by or "").strip()
    if not who:
        return (
            "Type your name in “Your name” first (this browser remembers it), "
            "then press the button again.",
            "error",
        )
    try:
        if button == "tl-note-add":
            if not (text := (text or "").strip()):
                return "Write the note first: what you saw or did, in a line.", "error"
            note = client.add_note(run, author=who, text=text, incident=incident)
            where = f" (incident {note.incident})" if note.incident is not None else ""
            return f"Note {note.id} added to run {run}{where} as {who}.", "info"
        if incident is None:
            return "Pick an incident first.", "error"
        if button == "tl-retitle":
            if not (title := (title or "").strip()):
                return "Type the new title first.", "error"
            done = client.retitle_incident(incident, by=who, title=title)
            return f"Incident {done.id} is now titled “{done.title}”.", "info"
        if button == "tl-close":
            done = client.close_incident(incident, by=who, summary=(summary or "").strip() or None)
            return f"Incident {done.id} closed by {who}.", "info"
    except Refused as exc:
        return f"Not done: {exc}.", "error"
    return f"Nothing to do for {button}.", "error"
