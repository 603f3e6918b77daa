"""What the agent's tests share: a transport that records what the agent sends, and
ranks run in processes of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..helpers import ROOT
from ..net import free_port


class RecordingTransport:
    def __init__(
        self, fail: bool = False, delay_s: float = 0.0, script: list[Exception] | None = None
    ) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.fail = fail
        self.delay_s = delay_s
        self.script = list(script or [])  # raised by the next sends, in order
        self.threads: set[str] = set()

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        if self.script:
            raise self.script.pop(0)
        if self.fail:
            raise ConnectionError("collector down")
        self.bodies.append(body)
        return {"accepted_steps": len(body["steps"]), "accepted_events": len(body["events"])}

    def close(self) -> None:
        pass

    def steps(self) -> list[dict[str, Any]]:
        return [s for b in self.bodies for s in b["steps"]]

    def events(self) -> list[dict[str, Any]]:
        return [e for b in self.bodies for e in b["events"]]


def run_ranks(
    world: int, mode: str, tmp_path: Path, *, module: str, timeout: float = 120
) -> list[dict[str, Any]]:
    """``world`` processes running ``module.rank_main(mode)`` on one gloo group; their JSON."""
    port = str(free_port())
    code = f"import sys; from {module} import rank_main; rank_main(*sys.argv[1:])"
    # The repository for ``tests``, before what the caller had (scripts/gpu_check.sh puts
    # the package there instead of installing it).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, mode, str(r), str(world), port, str(tmp_path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {r} exited {proc.returncode}:\n{outputs[r][-3000:]}"
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(world)]
