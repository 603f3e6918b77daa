"""Issue 56's fleet memory, end to end: two runs of the demo trainer (2 gloo ranks each,
forked warm), their rank 1 on node gpu-02 (``NODE_NAME``, as a scheduler sets it), each
hit by an XID there (the drill, on the simulated GPU). FatalXid fires in both; the node's
record lists both findings with their runs; RepeatOffenderNode fires while they run;
``trainwarden nodes exclude --format slurm`` prints the node, and ``nodes clear`` takes it
off the list."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers import Server, wait_for
from ..net import free_port
from .helpers import demo_ranks


def nodes_cli(server: Server, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "trainwarden.collector.cli", "nodes", *args, "--url", server.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_node_hit_in_two_runs_is_remembered_warned_about_and_excluded(
    live_server: Server, tmp_path: Path
) -> None:
    server = live_server
    stem = f"fleet-{free_port()}"
    runs = [f"{stem}-a", f"{stem}-b"]
    procs = []
    for run in runs:
        procs += demo_ranks(
            server,
            run,
            world=2,
            drill="xid=79@rank=1,step=5",
            steps=3000,
            work_ms=40,  # sleeps: on (until killed) while the evaluator reads the records again
            logs=tmp_path,
            per_rank=lambda rank: {"NODE_NAME": f"gpu-0{rank + 1}"},
        )
    try:

        def fired(rule: str) -> dict[str, str | None]:
            alerts = server.get("/api/v1/alerts", rule=rule, limit=100).json()
            return {a["run"]: a["node"] for a in alerts if a["run"] in runs}

        wait_for(lambda: len(fired("FatalXid")) == 2, 90, "FatalXid in both runs")
        assert fired("FatalXid") == {runs[0]: "gpu-02", runs[1]: "gpu-02"}
        wait_for(lambda: len(fired("RepeatOffenderNode")) == 2, 60, "RepeatOffenderNode")
        assert set(fired("RepeatOffenderNode").values()) == {"gpu-02"}
        warned = server.get("/api/v1/alerts", rule="RepeatOffenderNode", limit=10).json()
        assert "node gpu-02 was implicated in 2 runs" in warned[0]["annotations"]["description"]
    finally:
        for p in procs:
            p.kill()
            p.wait(30)

    record = server.get("/api/v1/nodes/gpu-02").json()
    xids = [f for f in record["findings"] if f["kind"] == "xid"]
    assert sorted(f["run"] for f in xids) == runs and all(f["rank"] == 1 for f in xids)
    assert all(f["step"] in (4, 5) for f in xids), xids  # the drill's step, or the last done
    assert [n["node"] for n in server.get("/api/v1/nodes").json()] == ["gpu-02"]

    assert nodes_cli(server, "exclude", "--format", "slurm") == "--exclude=gpu-02\n"
    assert "cleared" in nodes_cli(server, "clear", "gpu-02", "--note", "GPU reseated")
    assert nodes_cli(server, "exclude", "--format", "slurm") == ""
