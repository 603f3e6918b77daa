"""The Slurm backend: drain the node with a reason, then requeue the job with the node
excluded (``requeuehold`` -> ``ExcNodeList`` -> ``release``)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainwarden.collector.actions.evict.base import (
    Clock,
    EvictError,
    Eviction,
    EvictResult,
    run_command,
)


@dataclass
class SlurmBackend:
    """Drain the node, then requeue its job without it.

    1. ``scontrol update NodeName=NODE State=DRAIN Reason=...``: no new jobs there;
       the running ones go on until step 3.
    2. Find the job: ``e.job_id``, else ``squeue -w NODE`` (if several jobs run there,
       the ones named like the run; if none is, EvictError lists them).
    3. Per job, if it runs: ``scontrol requeuehold`` (its tasks are killed, it waits
       held), ``scontrol update JobId=... ExcNodeList=<old>,NODE``, ``scontrol release``.
       A pending job only gets the ExcNodeList update. With ``requeue=False`` only the
       node is drained.

    Slurm holds a requeued job back for ``AuthInfo=cred_expire`` (120 s by default)
    before it starts again.
    """

    scontrol: str = "scontrol"
    squeue: str = "squeue"
    requeue: bool = True
    env: Mapping[str, str] | None = None
    """Added to the collector's environment for every command (e.g. SLURM_CONF)."""
    name = "slurm"

    def evict(self, e: Eviction, *, timeout_s: float = 30.0) -> EvictResult:
        clock = Clock(timeout_s)
        steps: list[str] = []
        output: list[str] = []

        def run(*argv: str, record: bool = True) -> str:
            out = run_command(argv, clock=clock, steps=steps, env=self.env)
            if record:
                steps.append(shlex.join(argv))
                if out.strip():
                    output.append(out.strip())
            return out

        # The drain comes first: whatever fails after it, the bad node takes no new work.
        run(self.scontrol, "update", f"NodeName={e.node}", "State=DRAIN", f"Reason={e.reason}")
        if self.requeue:
            jobs = [e.job_id] if e.job_id else self._jobs_on(e, run, steps)
            for job in jobs:
                self._requeue_without(job, e.node, run, steps)
        return EvictResult(self.name, e.node, tuple(steps), "\n".join(output))

    def _jobs_on(self, e: Eviction, run: Any, steps: list[str]) -> list[str]:
        argv = (self.squeue, "-h", "-w", e.node, "-t", "CF,R,S", "-o", "%i|%j")
        rows = [line.split("|", 1) for line in run(*argv, record=False).splitlines() if line]
        jobs = [job for job, _ in rows]
        if len(jobs) > 1:
            jobs = [job for job, name in rows if name == e.run]
            if not jobs:
                listed = ", ".join(f"{job} ({name})" for job, name in rows)
                raise EvictError(
                    f"{len(rows)} jobs run on {e.node} and none is named {e.run!r}: {listed}; "
                    "give the job id (SLURM_JOB_ID)",
                    steps=steps,
                )
        steps.append(f"{shlex.join(argv)} -> {', '.join(jobs) or 'no job'}")
        return jobs

    def _requeue_without(self, job: str, node: str, run: Any, steps: list[str]) -> None:
        shown = run(self.scontrol, "show", "job", "-o", job, record=False)
        state = _field(shown, "JobState")
        excluded = _field(shown, "ExcNodeList")
        if excluded in ("", "(null)"):
            exclude = node
        elif node in excluded.split(","):
            exclude = excluded  # evicted before: keep the list as it is
        else:
            exclude = f"{excluded},{node}"
        if state == "PENDING":
            run(self.scontrol, "update", f"JobId={job}", f"ExcNodeList={exclude}")
            return
        if state == "COMPLETING":
            # Requeued a moment ago (another node's eviction) or ending: exclude if it
            # still takes an update; either way it is no longer on the node.
            try:
                run(self.scontrol, "update", f"JobId={job}", f"ExcNodeList={exclude}")
            except EvictError as exc:
                steps.append(f"job {job} is COMPLETING, not excluded: {exc}")
            return
        if state not in _RUNNING:
            steps.append(f"job {job} is {state or 'gone'}: nothing to requeue")
            return
        run(self.scontrol, "requeuehold", job)
        try:
            run(self.scontrol, "update", f"JobId={job}", f"ExcNodeList={exclude}")
        finally:
            # Never leave the job held, even if the exclusion failed: the drain alone
            # keeps it off the node while the node stays drained.
            try:
                run(self.scontrol, "release", job)
            except EvictError as exc:
                raise EvictError(
                    f"job {job} was requeued but stays held: {exc}; run `scontrol release {job}`",
                    steps=steps,
                ) from exc


def _field(scontrol_line: str, key: str) -> str:
    m = re.search(rf"(?:^|\s){key}=(\S*)", scontrol_line)
    return m.group(1) if m else ""


_RUNNING = {"RUNNING", "CONFIGURING", "SUSPENDED"}
