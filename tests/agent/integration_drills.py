"""What the framework integrations' unit tests hand the agent and read back: a
rollback's two commands, as the collector sends them, and its acknowledgement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainwarden.agent import core
from trainwarden.agent.integrations.common import TESTED

from .helpers import RecordingTransport


def rollback(
    path: Path, checkpoint_step: int, barrier_step: int, *, lr_scale: float | None = 0.5
) -> list[dict[str, Any]]:
    """Rollback 7's prepare and commit: back to ``path`` (the weights after update
    ``checkpoint_step``) after step ``barrier_step``."""
    plan = {
        "checkpoint_step": checkpoint_step,
        "checkpoint_path": str(path),
        "skip_from": checkpoint_step + 1,
        "skip_to": 12,
        "lr_scale": lr_scale,
        "reason": "test",
    }
    return [
        {"id": 1, "type": "rollback", "phase": "prepare", "action": 7, "plan": plan},
        {"id": 2, "type": "rollback", "phase": "commit", "action": 7, "barrier_step": barrier_step},
    ]


def applied(transport: RecordingTransport) -> dict[str, Any]:
    """The one acknowledgement that says whether the rollback was applied."""
    (ack,) = [
        e["data"]
        for e in transport.events()
        if e["kind"] == "command_ack" and e["data"].get("applied") is not None
    ]
    return ack


def said_untested(log: str, transport: RecordingTransport, framework: str, version: str) -> None:
    """``framework`` ``version`` was said to be outside its tested range, once, and left
    the training unobserved: no agent, nothing sent."""
    low, high = TESTED[framework]
    line = (
        f"trainwarden: {framework} {version} is outside the tested range >={low},<{high}: "
        "training goes on unobserved"
    )
    assert log.count(line) == 1, log
    assert core._agent is None and transport.bodies == []
