"""What the alerts page's buttons do, through the client to the API's own route
functions (no business rule is written twice): acknowledge, approve or cancel an action,
end a silence, silence what the form names.

With auth on, they act only for a session whose token has the ``admin`` scope; a
``read`` session is told it needs one, and nothing changes (docs/security.md). The name
field records who did it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...client import Client, Refused
from ...components import clock
from .panels import matchers_text

NEEDS_NAME = {"alerts-ack", "alerts-approve", "alerts-cancel", "alerts-silence-submit"}


@dataclass
class SilenceForm:
    """The silence form as typed; :meth:`matchers` says what is missing."""

    run: str | None = None
    rank: str | None = None
    alertname: str | None = None
    duration_s: float | None = 3600
    comment: str | None = None

    def matchers(self) -> list[dict[str, Any]]:
        given = (("run", self.run), ("rank", self.rank), ("alertname", self.alertname))
        out = [
            {"name": name, "value": value.strip()}
            for name, value in given
            if value and value.strip()
        ]
        if not out:
            raise Refused(
                "fill in at least one of run, rank and alert name: a silence names what it silences"
            )
        if self.rank and self.rank.strip() and not self.rank.strip().isdigit():
            raise Refused(f"rank {self.rank.strip()!r} is not a rank number; give one like 3")
        if not (self.comment or "").strip():
            raise Refused("say why in “Why”: whoever is paged next reads it")
        return out


def perform(client: Client, trigger: Any, *, by: str | None, form: SilenceForm) -> tuple[str, str]:
    """Do what the pressed button says; returns (message, notice kind) for the page."""
    kind = trigger if isinstance(trigger, str) else trigger["type"]
    index = 0 if isinstance(trigger, str) else int(trigger["index"])
    who = (by or "").strip()
    if kind in NEEDS_NAME and not who:
        return (
            "Type your name in “Your name” at the top first (this browser remembers it), "
            "then press the button again.",
            "error",
        )
    try:
        if kind == "alerts-ack":
            alert = client.ack(index, by=who)
            if alert.acked_by != who:
                return (
                    f"{alert.rule} (#{alert.id}) was already acknowledged by {alert.acked_by}.",
                    "info",
                )
            return (
                f"Acknowledged {alert.rule} (#{alert.id}) as {who}: it is no longer re-sent.",
                "info",
            )
        if kind in ("alerts-approve", "alerts-cancel"):
            action = client.decide(index, approve=kind == "alerts-approve", by=who)
            return (
                f"The {action.kind} #{action.id} of run {action.run} is now {action.state}.",
                "info",
            )
        if kind == "alerts-unsilence":
            ended = client.end_silence(index)
            return f"Silence #{ended.id} ({matchers_text(ended.matchers)}) ended.", "info"
        if kind == "alerts-silence-submit":
            made = client.silence(
                matchers=form.matchers(),
                duration_s=form.duration_s or 3600,
                by=who,
                comment=(form.comment or "").strip(),
            )
            return (
                f"Silenced {matchers_text(made.matchers)} until {clock(made.ends_at)} "
                f"(#{made.id}): matching alerts are listed, nobody is paged.",
                "info",
            )
    except Refused as exc:
        return f"Not done: {exc}.", "error"
    return f"Nothing to do for {kind}.", "error"
