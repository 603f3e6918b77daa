"""Eviction drill on a real two-node Slurm cluster on this host: a training job across
node1 and node2, an XID 79 on node2's rank, the collector fires FatalXid, its
``action: evict`` runs under an ``auto`` policy through the Slurm backend (or a user's
command backend), node2 is drained with a reason naming the XID, the job is requeued
and resumes on node1 alone from its latest checkpoint, and finishes.

Prints the time from the XID reaching the collector to the node being drained
(target <= 5 s).
"""

from __future__ import annotations

import re
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..helpers import start_serve, stop_serve, wait_for
from ..net import attempt_ports, free_port
from ..slurm import SlurmCluster, slurm_cluster


def attempt_port() -> str:
    """The rendezvous port of each attempt of a requeued job, in its task script: one of
    its own for each attempt, out of the range outgoing connections take theirs from
    (tests/net.py)."""
    ports = " ".join(map(str, attempt_ports(4)))
    return f"$(ports=({ports}); echo ${{ports[${{SLURM_RESTART_COUNT:-0}}]}})"


STEPS = 60


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster() as c:
        yield c


def backend_spec(kind: str, cluster: SlurmCluster, tmp_path: Path) -> str:
    if kind == "slurm":
        return f"{{backend: slurm, env: {{SLURM_CONF: '{cluster.conf}'}}}}"
    # A site's own script: drain through scontrol, then requeue the run's job.
    script = tmp_path / "drain.sh"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        set -eu
        export SLURM_CONF={cluster.conf}
        echo "$@" >> {tmp_path}/drain-calls.txt
        scontrol update NodeName="$1" State=DRAIN Reason="$2"
        for job in $(squeue -h -w "$1" -n "$3" -o %i); do scontrol requeue "$job"; done
        """)
    )
    script.chmod(0o755)
    return f"{{backend: command, argv: ['{script}', '{{node}}', '{{reason}}', '{{run}}']}}"


@pytest.mark.parametrize("kind", ["slurm", "command"])
def test_fatal_xid_drains_the_node_and_the_job_resumes_without_it(
    cluster: SlurmCluster, tmp_path: Path, kind: str
) -> None:
    cluster.reset()
    db_url = f"sqlite:///{tmp_path / 'tw.db'}"
    actions = tmp_path / "actions.yaml"
    actions.write_text(
        textwrap.dedent(f"""\
        evict:
          mode: auto
          backend: {backend_spec(kind, cluster, tmp_path)}
          max_nodes_fraction_per_hour: 0.5   # one node of two
        """)
    )
    port = free_port()
    server = start_serve(
        db_url, tmp_path / "serve.log", port=port, env={"TRAINWARDEN_ACTIONS": str(actions)}
    )
    run = f"evict-{kind}-{uuid.uuid4().hex[:6]}"
    ckpt = tmp_path / "ckpt"
    task = tmp_path / "task.sh"
    task.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=0 OMP_NUM_THREADS=1
        export MASTER_ADDR=127.0.0.1 MASTER_PORT={attempt_port()}
        export TRAINWARDEN_FLUSH_INTERVAL=0.5 TRAINWARDEN_PROFILE_EVERY=0
        export TRAINWARDEN_GPU_INTERVAL=1
        if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
            export TRAINWARDEN_DRILL="xid=79@rank=1,step=25"
        fi
        echo "attempt ${{SLURM_RESTART_COUNT:-0}}: rank $RANK of $WORLD_SIZE on $SLURMD_NODENAME"
        exec {sys.executable} -m trainwarden.agent.demo_trainer --run-name {run} \\
            --url {server.url} --steps {STEPS} --work-ms 100 --batch-size 16 \\
            --checkpoint-dir {ckpt} --checkpoint-every 10
        """)
    )
    task.chmod(0o755)
    try:
        job = cluster.sbatch(
            "--requeue",
            "-N1-2",
            "--open-mode=append",
            "-J",
            run,
            script=f"srun --ntasks-per-node=1 {task}",
        )
        cluster.wait_job(job, "COMPLETED", timeout=180)
        out = cluster.output(job)
        assert (
            "attempt 0: rank 1 of 2 on node2" in out and "attempt 1: rank 0 of 1 on node1" in out
        ), out
        resumed = re.search(r"resumed from \S*/step-(\d+)\.pt at step (\d+)", out)
        assert resumed, out
        # The newest checkpoint attempt 0 wrote: step 20 (the last before the XID at 25)
        # or a later one, as far as it got before the requeue stopped it (how long that
        # took is timed below; at 100 ms a step, 20 needs it under ~0.5 s).
        newest, at = int(resumed[1]), int(resumed[2])
        assert newest >= 20 and newest % 10 == 0 and at == newest + 1, out
        assert cluster.job(job)["Restarts"] == "1"
        assert cluster.node_state("node2").startswith("drain"), cluster.describe()
        assert "FatalXid" in cluster.node_reason("node2") and "XID 79" in cluster.node_reason(
            "node2"
        )

        (action,) = wait_for(
            lambda: [
                a
                for a in server.get("/api/v1/actions", run=run).json()
                if a["state"] in ("done", "failed")
            ],
            60,
            "the eviction done",
        )
        assert (action["state"], action["kind"], action["node"], action["trigger"]) == (
            "done",
            "evict",
            "node2",
            "rule:FatalXid",
        ), action
        if kind == "slurm":
            assert any("State=DRAIN" in s for s in action["result"]["steps"])
            assert any("requeuehold" in s for s in action["result"]["steps"])
        else:
            (call,) = (tmp_path / "drain-calls.txt").read_text().splitlines()
            assert call.startswith("node2 trainwarden: FatalXid") and call.endswith(run)
        series = server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
        assert max(series["step"]) == STEPS - 1
        # Two attempts (Slurm's restart count): the first ended by the eviction, on 2 nodes;
        # the second ran on node1 alone and completed.
        tries = wait_for(
            lambda: (
                (t := server.get(f"/api/v1/runs/{run}/attempts").json())
                and len(t) == 2
                and t[1]["state"] == "ended"
                and t
            ),
            30,
            "two attempts",
        )
        assert [(t["key"], t["world_size"]) for t in tries] == [
            (f"slurm:{job}:0", 2),
            (f"slurm:{job}:1", 1),
        ]
        assert (
            tries[0]["exit_reason"] == "evicted"
            and f"node node2 evicted by action {action['id']}" in tries[0]["exit_detail"]
        )
        assert tries[1]["exit_reason"] == "completed" and tries[1]["nodes"] == ["node1"]

        (xid,) = server.get(f"/api/v1/runs/{run}/events", kind="xid").json()
        drained = action["plan"]["evicted_at"] - xid["recv_ts"]
    finally:
        stop_serve(server)
        cluster.reset()
    print(
        f"\n{kind} backend: XID 79 reached the collector -> node2 drained and the job requeued "
        f"{drained:.1f} s later"
    )
    assert drained <= 5.0, f"target: drained within 5 s of the XID (took {drained:.1f} s)"


SDC_STEPS = 140
SDC_RULES = """\
rules:
  - name: SilentDataCorruption
    kind: event
    summary: A rank's parameters differ from its replicas' (drill rule, evicting and rolling back).
    params: {match: event, events: [replica_divergence], per_rank: true}
    keep_firing_for: 1h
    severity: critical
    runbook: SilentDataCorruption.md
    action: evict+rollback
"""


def test_a_corrupted_replica_s_node_is_drained_and_the_job_back_without_it_restores_clean(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """4 ranks on 2 Slurm nodes (2 a node), DDP, replica checks every 10 steps; rank 2 (on
    node2) flips a bit at step 35. SilentDataCorruption (``action: evict+rollback``)
    drains node2 through the command backend, which requeues the job; the job comes back
    on node1 alone (4 ranks) and resumes from its newest checkpoint, saved after the
    divergence; the rollback, which waited for it, then restores the checkpoint of step
    30 on every rank, and the replicas agree at every check from then on."""
    cluster.reset()
    actions = tmp_path / "actions.yaml"
    actions.write_text(
        textwrap.dedent(f"""\
        evict:
          mode: auto
          backend: {backend_spec("command", cluster, tmp_path)}
          max_nodes_fraction_per_hour: 0.5
        rollback:
          mode: auto
        """)
    )
    rules = tmp_path / "rules.yaml"
    rules.write_text(SDC_RULES)
    server = start_serve(
        f"sqlite:///{tmp_path / 'tw.db'}",
        tmp_path / "serve.log",
        env={
            "TRAINWARDEN_ACTIONS": str(actions),
            "TRAINWARDEN_RULES": str(rules),
            "TRAINWARDEN_DEFAULT_RULES": "0",
        },
    )
    run = f"sdc-evict-{uuid.uuid4().hex[:6]}"
    ckpt = tmp_path / "ckpt"
    task = tmp_path / "task.sh"
    task.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
        export OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1
        export MASTER_PORT={attempt_port()}
        export TRAINWARDEN_FLUSH_INTERVAL=0.5 TRAINWARDEN_PROFILE_EVERY=0
        if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
            export TRAINWARDEN_DRILL="sdc=bitflip@rank=2,step=35"
        fi
        echo "attempt ${{SLURM_RESTART_COUNT:-0}}: rank $RANK of $WORLD_SIZE on $SLURMD_NODENAME"
        exec {sys.executable} -m trainwarden.agent.demo_trainer --run-name {run} \\
            --url {server.url} --steps {SDC_STEPS} --work-ms 40 --batch-size 16 \\
            --checkpoint-dir {ckpt} --checkpoint-every 10 --replica-check-every 10
        """)
    )
    task.chmod(0o755)
    try:
        job = cluster.sbatch(
            "--requeue",
            "-N1-2",
            "--ntasks=4",
            "--overcommit",
            "--open-mode=append",
            "-J",
            run,
            script=f"srun --ntasks=4 --overcommit --distribution=block {task}",
        )
        cluster.wait_job(job, "COMPLETED", timeout=240)
        out = cluster.output(job)
        assert "attempt 0: rank 2 of 4 on node2" in out, out
        # Requeued without node2, the job keeps its 4 ranks, all on node1 (overcommitted).
        assert "attempt 1: rank 2 of 4 on node1" in out, out
        assert cluster.node_state("node2").startswith("drain"), cluster.describe()
        assert "SilentDataCorruption" in cluster.node_reason("node2")
        done = wait_for(
            lambda: (
                (a := server.get("/api/v1/actions", run=run).json())
                and all(x["state"] in ("done", "failed") for x in a)
                and a
            ),
            60,
            "the eviction and the rollback done",
        )
        events = server.get(f"/api/v1/runs/{run}/events", kind="replica_divergence").json()
        ckpts = server.get(f"/api/v1/runs/{run}/checkpoints").json()
        results = server.get(f"/api/v1/runs/{run}/replicas").json()
        tries = server.get(f"/api/v1/runs/{run}/attempts").json()
        report = server.get(f"/api/v1/runs/{run}/postmortem", format="md").text
    finally:
        stop_serve(server)
        cluster.reset()
    # One eviction (node2) and one rollback: the alert must not fire again for its old
    # event once the job is back on node1 (it did, and evicted node1: refused by the guard).
    assert [(a["node"], a["state"]) for a in done if a["kind"] == "evict"] == [("node2", "done")], (
        done
    )
    assert len(done) == 2, done
    evict, rollback = sorted(done, key=lambda a: a["id"])
    assert (evict["kind"], evict["state"], evict["node"]) == ("evict", "done", "node2"), evict
    assert (rollback["kind"], rollback["state"]) == ("rollback", "done"), rollback
    assert rollback["plan"]["after_evict"] == evict["id"]
    assert rollback["plan"]["ranks"] == [0, 1, 2, 3]  # the attempt that came back
    restored = {r["checkpoint_step"] for r in rollback["result"]["ranks"].values()}
    assert restored == {30}, rollback["result"]
    assert out.count("rolled back to step 30 after step") == 4, out
    assert out.count("replaying the same batches") == 4, out  # no data window skipped
    # The job came back from its newest checkpoint, saved after the divergence (suspect).
    resumed = re.search(r"resumed from \S*/step-(\d+)\.pt at step (\d+)", out)
    assert resumed and int(resumed[1]) >= 40, out
    # Step 40's checkpoint was saved twice: before the alert (suspect: never restored) and
    # by the replay from step 30 (good again).
    assert [c["good"] for c in ckpts if c["step"] == 40] == [False, True], ckpts
    first = events[0]
    assert (first["rank"], first["step"], first["data"]["clean_through"]) == (2, 40, 30)
    assert {e["rank"] for e in events} == {2}
    assert [(t["world_size"], sorted(t["nodes"])) for t in tries] == [
        (4, ["node1", "node2"]),
        (4, ["node1"]),
    ]
    assert tries[0]["exit_reason"] in ("evicted", "sigterm"), tries[0]
    # Every step after the checkpoint was run again from clean parameters: the last
    # comparison of every checked step agrees (those of steps 40-60 replaced).
    assert [r["step"] for r in results] == list(range(0, SDC_STEPS, 10)), results
    assert all(r["agree"] for r in results), results
    # The post-mortem tells it in order: fault, detection, alert, eviction, the job back,
    # the rollback, with the steps lost to it.
    story = [
        "fault injected (drill): sdc=bitflip@rank=2,step=35",
        "replicas disagree (parameters): rank 2's parameters differ from its replica group's",
        "SilentDataCorruption firing",
        "evict of node node2 executing: evicting node2 through command",
        "attempt 1 ended (evicted): node node2 evicted by action",
        "attempt 2 started: world size 4 on node1; resumed at step",
        "every rank (4) restored checkpoint step 30 after step",
    ]
    at = [report.find(line) for line in story]
    assert -1 not in at, list(zip(story, at, strict=True))
    # The auto action starts in the pass that sees the alert fire: the two stamps come from
    # two passes' clocks in the same second and may read in either order (seen in CI).
    firing, executing = at[2], at[3]
    at[2] = at[3] = min(firing, executing)
    assert at == sorted(at), list(zip(story, at, strict=True))
    assert "evict of node node2 done" in report  # (when its ranks' stops are answered)
    (barrier,) = {r["barrier_step"] for r in rollback["result"]["ranks"].values()}
    assert f"**Steps lost**: {barrier - 30}" in report, report
    print(
        f"\nrank 2 flipped at step 35: found at step {first['step']}; node2 evicted "
        f"({evict['result']['drained_within_s']} s); the job came back from step "
        f"{resumed[1]} and rolled back to step 30"
    )
