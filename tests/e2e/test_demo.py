"""The README's demo command, as a user runs it (shortened)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from trainwarden.collector.db import make_engine
from trainwarden.collector.queries import events, list_runs, series

from ..conftest import free_port


def test_demo_serves_and_trains_two_ranks_on_the_embedded_default(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    env.pop("TRAINWARDEN_DB", None)
    port = free_port()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainwarden.collector.cli",
            "demo",
            "--steps",
            "25",
            "--data-delay",
            "0",
            "--port",
            str(port),
            "--exit-when-done",
            "--drill",
            "xid=79@rank=1,step=10",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"dashboard http://127.0.0.1:{port}/runs/demo-" in result.stdout
    assert "training finished" in result.stdout
    # The XID drill raised FatalXid, listed at the end with its runbook.
    assert "firing   critical FatalXid rank 1: rank 1" in result.stdout, result.stdout
    assert f"runbook: http://127.0.0.1:{port}/runbooks/FatalXid" in result.stdout

    db = tmp_path / "trainwarden" / "trainwarden.db"
    assert db.exists()
    with make_engine(f"sqlite:///{db}").connect() as conn:
        (run,) = list_runs(conn)
        assert (run.world_size, run.ranks_seen, run.last_step, run.status) == (2, 2, 24, "finished")
        loss = series(conn, run=run.name, metric="loss")
        assert loss.n == [2] * 25
        # The demo trainer checkpoints (step 0 here), so that a rollback has a target.
        assert [e.step for e in events(conn, run=run.name, kind="checkpoint")] == [0]
    assert f"checkpoint every 250 steps in {tempfile.gettempdir()}" in result.stdout
