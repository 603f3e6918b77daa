"""A short chaos run (bench/chaos.py): 2 trainer processes while the collector is
killed with SIGKILL twice, its PostgreSQL restarted and the network cut. Every record
the agents recorded is stored exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..helpers import ROOT


def test_nothing_is_lost_or_duplicated_through_kills_a_database_restart_and_a_cut(
    tmp_path: Path,
) -> None:
    out = tmp_path / "chaos.json"
    run = subprocess.run(
        [
            sys.executable,
            "chaos.py",
            "--ranks",
            "2",
            "--seconds",
            "40",
            "--cut-s",
            "8",
            "--json",
            str(out),
        ],
        cwd=ROOT / "bench",
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    print(run.stdout)
    f = json.loads(out.read_text())
    assert len(f["faults"]) == 4 and any("network cut" in x for x in f["faults"])
    assert f["recorded"] > 200
    assert (f["lost"], f["duplicated"]) == (0, 0), f["ranks"]
    assert f["stored"] == f["recorded"]
    assert f["spooled"] > 0 and f["replayed"] == f["spooled"]  # the outages went through the spool
    for rank in f["ranks"]:
        assert rank["steps_stored"] == rank["steps_run"] and rank["dropped"] == 0, rank
