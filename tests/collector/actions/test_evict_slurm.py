"""The Slurm eviction backend against a two-node Slurm cluster on this host: it drains
the node and requeues the run's job without it; how its failures read, and a hung
scontrol killed at the timeout. And the exclude list ``trainwarden nodes exclude``
prints keeps the next job off a node that hurt two runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainwarden.collector.actions.evict import EvictError, Eviction, SlurmBackend

from ...slurm import SlurmCluster, slurm_cluster
from ..node_findings import HOUR, NOW, add_alert, add_run
from .evict_helpers import REASON

# Each task prints the environment a trainer reads, then trains (sleeps) until killed.
TASK = """\
import json, os, time
keys = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURMD_NODENAME", "SLURM_RESTART_COUNT")
print(json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster() as c:
        yield c


@pytest.fixture
def slurm(cluster: SlurmCluster) -> SlurmCluster:
    cluster.reset()
    return cluster


def backend(cluster: SlurmCluster, **kwargs: Any) -> SlurmBackend:
    return SlurmBackend(env={"SLURM_CONF": str(cluster.conf)}, **kwargs)


def tasks(cluster: SlurmCluster, job: str) -> list[dict[str, str | None]]:
    return [json.loads(line) for line in cluster.output(job).splitlines() if line.startswith("{")]


def start_training(cluster: SlurmCluster, tmp_path: Path) -> str:
    """A requeueable job that may run on 1 or 2 nodes: Slurm gives it both when both are
    free, and after an eviction it runs again on the one that is left."""
    (tmp_path / "task.py").write_text(TASK)
    job = cluster.sbatch(
        "--requeue",
        "-N1-2",
        "--open-mode=append",  # keep the first attempt's lines after the requeue
        script=f"srun --ntasks-per-node=1 {sys.executable} {tmp_path / 'task.py'}",
    )
    cluster.wait_for("2 tasks on node1 and node2", lambda: len(tasks(cluster, job)) == 2)
    assert cluster.job_nodes(job) == ["node1", "node2"]
    return job


def test_slurm_drains_the_node_and_requeues_the_job_without_it(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    job = start_training(slurm, tmp_path)

    t0 = time.monotonic()
    result = backend(slurm).evict(Eviction(node="node2", reason=REASON, run="wrap"))
    took = time.monotonic() - t0
    print(f"\nSlurm eviction (drain + requeue through scontrol): {took:.2f} s")
    assert result.backend == "slurm" and result.node == "node2"
    assert result.steps == (
        f"scontrol update NodeName=node2 State=DRAIN 'Reason={REASON}'",
        f"squeue -h -w node2 -t CF,R,S -o '%i|%j' -> {job}",
        f"scontrol requeuehold {job}",
        f"scontrol update JobId={job} ExcNodeList=node2",
        f"scontrol release {job}",
    )
    assert slurm.node_state("node2") in ("draining", "drained")
    assert slurm.node_reason("node2") == REASON
    assert slurm.node_state("node1") != "drained"
    shown = slurm.job(job)
    assert shown["ExcNodeList"] == "node2"
    assert shown["Restarts"] == "1"
    assert shown["JobState"] in ("COMPLETING", "PENDING", "RUNNING")
    assert "held" not in shown["Reason"].lower(), shown  # released: it starts by itself

    # Slurm holds a requeued job back for cred_expire (5 s here, 120 s by default).
    slurm.wait_for("the requeued job's task", lambda: len(tasks(slurm, job)) == 3, timeout=20)
    assert slurm.job_nodes(job) == ["node1"]
    assert slurm.node_state("node2") == "drained"
    first = sorted(tasks(slurm, job)[:2], key=lambda t: str(t["SLURM_PROCID"]))
    assert [(t["SLURM_PROCID"], t["SLURMD_NODENAME"], t["SLURM_NTASKS"]) for t in first] == [
        ("0", "node1", "2"),
        ("1", "node2", "2"),
    ]
    assert tasks(slurm, job)[2] == {
        "SLURM_JOB_ID": job,
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURMD_NODENAME": "node1",
        "SLURM_RESTART_COUNT": "1",
    }


def test_slurm_with_a_job_id_and_requeue_off_only_drains(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    job = slurm.sbatch("--requeue", "-N1-2", wrap="sleep 300")
    slurm.wait_job(job, "RUNNING")

    result = backend(slurm, requeue=False).evict(
        Eviction(node="node2", reason="drill\nsecond line", run="r", job_id=job)
    )

    assert result.steps == (
        "scontrol update NodeName=node2 State=DRAIN 'Reason=drill second line'",
    )
    assert slurm.node_state("node2") == "draining"  # the job still runs there
    assert slurm.node_reason("node2") == "drill second line"
    assert slurm.job_state(job) == "RUNNING"
    assert slurm.job_nodes(job) == ["node1", "node2"]


def test_slurm_finds_the_runs_job_among_the_jobs_on_the_node(slurm: SlurmCluster) -> None:
    gpt = slurm.sbatch("--requeue", "-N1-2", "--oversubscribe", "-J", "gpt", wrap="sleep 300")
    slurm.wait_job(gpt, "RUNNING")
    other = slurm.sbatch(
        "--requeue", "-w", "node2", "--oversubscribe", "-J", "other", wrap="sleep 300"
    )
    slurm.wait_job(other, "RUNNING")

    with pytest.raises(EvictError, match=r"2 jobs run on node2 and none is named 'bert': "):
        backend(slurm).evict(Eviction(node="node2", reason=REASON, run="bert"))
    result = backend(slurm).evict(Eviction(node="node2", reason=REASON, run="gpt"))

    assert f"squeue -h -w node2 -t CF,R,S -o '%i|%j' -> {gpt}" in result.steps
    assert f"scontrol requeuehold {gpt}" in result.steps
    assert slurm.job(gpt)["Restarts"] == "1"
    assert slurm.job_state(other) == "RUNNING"  # not the run's job: left alone


def test_slurm_job_that_may_not_be_requeued(slurm: SlurmCluster) -> None:
    job = slurm.sbatch("--no-requeue", "-N1-2", wrap="sleep 300")
    slurm.wait_job(job, "RUNNING")
    with pytest.raises(
        EvictError,
        match=rf"`scontrol requeuehold {job}` exited 1: Requested operation is presently disabled",
    ) as err:
        backend(slurm).evict(Eviction(node="node2", reason=REASON, run="r", job_id=job))
    assert len(err.value.steps) == 1  # the drain
    assert slurm.node_state("node2") == "draining"
    assert slurm.job_state(job) == "RUNNING"


def test_slurm_a_second_node_of_a_requeued_job_is_added_to_the_exclusions(
    slurm: SlurmCluster,
) -> None:
    job = slurm.sbatch("--requeue", "-N1-2", wrap="sleep 300")
    slurm.wait_job(job, "RUNNING")
    backend(slurm).evict(Eviction(node="node2", reason=REASON, run="r", job_id=job))
    result = backend(slurm).evict(Eviction(node="node1", reason=REASON, run="r", job_id=job))
    assert result.steps[-1] == f"scontrol update JobId={job} ExcNodeList=node2,node1"
    assert slurm.job(job)["ExcNodeList"] == "node2,node1"
    assert slurm.job(job)["Restarts"] == "1"  # requeued once


def test_slurm_unknown_node_fails_in_slurms_words(slurm: SlurmCluster) -> None:
    with pytest.raises(
        EvictError,
        match=r"^`scontrol update NodeName=node9 State=DRAIN 'Reason=.*'` exited 1: "
        r"slurm_update error: Invalid node name specified$",
    ) as err:
        backend(slurm).evict(Eviction(node="node9", reason=REASON, run="r"))
    assert err.value.steps == ()
    assert [slurm.node_state(n) for n in slurm.nodes] == ["idle", "idle"]


def test_slurm_unknown_job_fails_after_the_drain(slurm: SlurmCluster) -> None:
    with pytest.raises(EvictError, match="Invalid job id specified") as err:
        backend(slurm).evict(Eviction(node="node2", reason=REASON, run="r", job_id="999999"))
    # The bad node is drained whatever happens next; the error lists that it was.
    assert slurm.node_state("node2") == "drained"
    assert err.value.steps == (f"scontrol update NodeName=node2 State=DRAIN 'Reason={REASON}'",)


def test_slurm_wrong_scontrol_path() -> None:
    b = SlurmBackend(scontrol="/nonexistent/scontrol")
    with pytest.raises(EvictError, match="cannot run '/nonexistent/scontrol': No such file"):
        b.evict(Eviction(node="node2", reason=REASON, run="r", job_id="12"))


def test_slurm_hanging_command_is_killed_at_the_timeout(tmp_path: Path) -> None:
    pids, returned = tmp_path / "pids", tmp_path / "returned"
    hang = tmp_path / "scontrol"
    # The script and a child of its own both hold the output pipes; either, if it outlived
    # its 60 s, would say so in `returned`.
    hang.write_text(
        f"#!/bin/sh\n(sleep 60; touch {returned}) &\necho $$ $! > {pids}\n"
        f"sleep 60\ntouch {returned}\n"
    )
    hang.chmod(0o755)

    with pytest.raises(EvictError, match=r"timed out after 1 s \(killed\)"):
        SlurmBackend(scontrol=str(hang)).evict(
            Eviction(node="node2", reason=REASON, run="r", job_id="12"), timeout_s=1
        )
    assert not returned.exists()  # it returned while both still hung: it did not wait on them
    for pid in pids.read_text().split():
        deadline = time.monotonic() + 2  # SIGKILL was sent; its delivery takes a moment
        while _alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(int(pid)), f"pid {pid} of the timed-out command still runs"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_job_started_with_the_printed_exclude_list_avoids_the_bad_node(
    slurm: SlurmCluster, engine: Any, db_url: str
) -> None:
    with engine.begin() as conn:  # node1 hurt two runs: an XID in each
        for name in ("a", "b"):
            run_id = add_run(conn, name, {0: "node1", 1: "node2"})
            add_alert(conn, run_id, "FatalXid", "node1", NOW - HOUR, finding="xid")
    done = subprocess.run(
        [sys.executable, "-m", "trainwarden.collector.cli", "nodes", "exclude"]
        + ["--format", "slurm", "--db", db_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (0, "--exclude=node1\n"), done.stderr
    exclude = done.stdout.strip()
    # Both nodes could take a one-node job, and a two-node job needs both: with the list,
    # the first lands on node2 only and the second cannot be placed at all.
    job = slurm.sbatch(exclude, "-N1", wrap="echo $SLURMD_NODENAME; sleep 30")
    slurm.wait_job(job, "RUNNING")
    assert slurm.job_nodes(job) == ["node2"]
    with pytest.raises(RuntimeError, match="sbatch exited"):
        slurm.sbatch(exclude, "-N2", wrap="true")
