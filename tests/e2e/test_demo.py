"""The README's demo command, as a user runs it (shortened): its drills raise their alerts,
and its own action policy rolls the loss spike back on every rank."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from trainwarden.collector.read.queries import events, list_runs
from trainwarden.collector.read.series import series
from trainwarden.collector.store.db import make_engine

# LossSpike (the default pack's) compares the loss with its median over 200 steps after a
# 50-step warm-up: the spike comes just after that and after the checkpoint at step 250.
# The alert goes pending a pass or two later and fires 20 steps after that: at the demo's
# ~60 ms a step, 40-120 steps after the spike; the run goes on long enough for the rollback.
SPIKE, STEPS = 258, 420


def test_demo_serves_and_trains_two_ranks_on_the_embedded_default(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    env.pop("TRAINWARDEN_DB", None)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainwarden.collector.cli",
            "demo",
            "--steps",
            str(STEPS),
            "--port",
            "0",  # a free one, which the demo holds from then on and names
            "--exit-when-done",
            "--drill",
            f"xid=79@rank=1,step=10; loss_spike=1000x@step={SPIKE}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    said = re.search(r"dashboard http://127\.0\.0\.1:(\d+)/runs/demo-", result.stdout)
    assert said, result.stdout
    port = int(said.group(1))
    assert port > 0 and "is taken" not in result.stdout, result.stdout
    assert "training finished" in result.stdout
    assert "actions: rollback auto, evict dry-run, stop dry-run" in result.stdout
    # The XID drill raised FatalXid, listed at the end with its runbook; its eviction is a
    # dry run. The loss spike raised LossSpike, and its rollback ran.
    assert "firing   critical FatalXid rank 1: rank 1" in result.stdout, result.stdout
    assert f"runbook: http://127.0.0.1:{port}/runbooks/FatalXid" in result.stdout
    assert "critical LossSpike: run: loss" in result.stdout, result.stdout
    assert "evict    done     dry-run  rule:FatalXid: dry run, nothing done" in result.stdout
    rolled_back = (
        "rollback done     auto     rule:LossSpike: "
        "every rank (2) restored the checkpoint of step 250 after step"
    )
    assert rolled_back in result.stdout, result.stdout
    # Nothing the demo did not inject pages: its input pipeline is healthy. On a loaded
    # host (a CI run's other worker) the gap between steps can pass a fifth of a step for
    # a while: DataLoaderStall may then be pending, and its 5 minutes' `for` keeps it from
    # firing in the demo's minute. Only the injected alerts fire.
    listed = [line.split() for line in result.stdout.splitlines() if line.startswith("  ")]
    alerts = [(words[0], words[2].rstrip(":")) for words in listed if len(words) > 2]
    firing = {name for state, name in alerts if state == "firing"}
    assert firing <= {"FatalXid", "LossSpike", "GradNormSpikeBurst"}, result.stdout
    stalls = [state for state, name in alerts if name == "DataLoaderStall"]
    assert set(stalls) <= {"pending"}, result.stdout

    db = tmp_path / "trainwarden" / "trainwarden.db"
    assert db.exists()
    with make_engine(f"sqlite:///{db}").connect() as conn:
        (run,) = list_runs(conn)
        assert (run.world_size, run.ranks_seen, run.last_step, run.status) == (
            2,
            2,
            STEPS - 1,
            "finished",
        )
        loss = series(conn, run=run.name, metric="loss")
        assert loss.n == [2] * STEPS
        # After the rollback the replayed steps are the ones kept, and the loss is back on
        # the trend it had before the spike.
        by_step = dict(zip(loss.step, loss.median, strict=True))
        before = statistics.median(by_step[s] for s in range(SPIKE - 20, SPIKE))
        after = statistics.median(by_step[s] for s in range(STEPS - 20, STEPS))
        assert after < 1.1 * before, (before, after)
        # The demo trainer checkpoints every 250 steps (the rollback's target), and again
        # on its way past 250 after the rollback.
        steps = [e.step for e in events(conn, run=run.name, kind="checkpoint")]
        assert steps[:2] == [0, 250] and set(steps) == {0, 250}, steps
    assert f"checkpoint every 250 steps in {tempfile.gettempdir()}" in result.stdout
