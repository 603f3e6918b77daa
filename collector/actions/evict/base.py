"""What every eviction backend shares: the eviction asked for (checked: a node name that
cannot reach other nodes, a bounded reason), its result and error, the backend protocol,
and running a command within the eviction's time budget."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


class EvictError(Exception):
    """An eviction failed; the message says which step and why. ``steps`` lists what
    had already been done (for instance the node drained, the requeue refused)."""

    def __init__(self, message: str, *, steps: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.steps = tuple(steps)


@dataclass(frozen=True)
class Eviction:
    """What to evict. Checked here so that no backend ever sees a bad node name."""

    node: str
    """Scheduler node name (agents report SLURMD_NODENAME / NODE_NAME)."""
    reason: str
    """Why, e.g. "trainwarden: FatalXid XID 79 on rank 3"; made one short line."""
    run: str
    job_id: str | None = None
    """Scheduler job id when known (SLURM_JOB_ID); else the backend looks it up."""
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.node or _BAD_NODE.search(self.node) or self.node.startswith("-"):
            raise ValueError(
                f"node {self.node!r} is not one node name (no spaces, commas, brackets, "
                "quotes or '=': a hostlist would drain other nodes)"
            )
        if self.job_id is not None and not re.fullmatch(r"[0-9]+([_+][0-9]+)?", self.job_id):
            raise ValueError(f"job_id {self.job_id!r} is not a Slurm job id (e.g. 12 or 12_3)")
        reason = " ".join(self.reason.split())  # newlines and tabs would break sinfo -R
        if len(reason) > MAX_REASON:
            reason = reason[: MAX_REASON - 3] + "..."
        object.__setattr__(self, "reason", reason or "trainwarden")
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))

    def fields(self) -> dict[str, str]:
        """The template values: {node} {reason} {run} {job_id} {ranks} ("3,5")."""
        return {
            "node": self.node,
            "reason": self.reason,
            "run": self.run,
            "job_id": self.job_id or "",
            "ranks": ",".join(str(r) for r in self.ranks),
        }


@dataclass(frozen=True)
class EvictResult:
    backend: str
    node: str
    steps: tuple[str, ...]
    """What was done, in order, human readable (the commands or API calls)."""
    output: str = ""


class EvictionBackend(Protocol):
    name: str

    def evict(self, e: Eviction, *, timeout_s: float = 30.0) -> EvictResult:
        """Blocking; raises EvictError; returns within timeout_s."""
        ...


def tail_of(text: str, limit: int = 500) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


class Clock:
    """The overall deadline of one eviction."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s

    def left(self, what: str, steps: Sequence[str]) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise EvictError(f"timed out after {self.timeout_s:g} s before {what}", steps=steps)
        return left


def run_command(
    argv: Sequence[str],
    *,
    clock: Clock,
    steps: Sequence[str],
    env: Mapping[str, str] | None,
) -> str:
    """Run argv (no shell) within the deadline; its stdout. Any failure is an EvictError
    naming the command, with the exit code and the tail of stderr."""
    cmd = shlex.join(argv)
    left = clock.left(cmd, steps)
    try:
        # A session of its own, so that a timeout kills the command's children too.
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
            start_new_session=True,
        )
    except OSError as exc:
        raise EvictError(f"cannot run {argv[0]!r}: {exc.strerror or exc}", steps=steps) from exc
    try:
        out, err = proc.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise EvictError(
            f"`{cmd}` timed out after {clock.timeout_s:g} s (killed)", steps=steps
        ) from None
    if proc.returncode != 0:
        detail = tail_of(err or out) or "(no output)"
        raise EvictError(f"`{cmd}` exited {proc.returncode}: {detail}", steps=steps)
    return out


def _kill(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    try:
        # A grandchild that left the group may still hold the pipes: do not wait on it.
        proc.communicate(timeout=1)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait(1)


PLACEHOLDERS = ("node", "reason", "run", "job_id", "ranks")


MAX_REASON = 200  # Slurm keeps any length, but sinfo and squeue lines should stay readable


_BAD_NODE = re.compile(r"[\s,\[\]=\"']")  # a hostlist or option would reach other nodes
