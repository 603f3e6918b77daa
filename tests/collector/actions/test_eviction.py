"""Evictions through a real command backend (SQLite and PostgreSQL): an XID evicts its
node once and stops the ranks there, a refusal fails with the backend's error, the
cool-down and the blast-radius guard, and ``evict+rollback``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from trainwarden.agent.commands import STOPPED_EXIT_CODE
from trainwarden.collector.alerting.engine import AlertEngine

from .helpers import (
    AUTO_ROLLBACK,
    RULES,
    RUN,
    Cluster,
    Rank,
    action,
    commands,
    events,
    settle,
    states,
)


class Script:
    """The command backend's script: records its arguments (one a line) and exits ``code``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def argv(self, code: int = 0, stderr: str = "") -> list[str]:
        path = self.folder / "evict.sh"
        path.write_text(
            f'#!/bin/sh\nprintf "%s\\n" "$@" > "{self.folder}/argv-$1"\n'
            + (f'echo "{stderr}" >&2\n' if stderr else "")
            + f'echo "drained $1"\nexit {code}\n'
        )
        path.chmod(0o755)
        return [str(path), "{node}", "{reason}", "{ranks}", "{run}"]

    def ran(self, node: str) -> list[str] | None:
        """The arguments it was run with for ``node``; None if it was not."""
        path = self.folder / f"argv-{node}"
        return path.read_text().splitlines() if path.exists() else None


@pytest.fixture
def script(tmp_path: Path) -> Script:
    return Script(tmp_path)


def evict_policy(argv: list[str], **evict: Any) -> dict[str, Any]:
    return {"evict": {"mode": "auto", "backend": {"backend": "command", "argv": argv}, **evict}}


def evicting(run: Cluster, action_id: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """Passes of the engine (the clock standing still) until the backend, which runs in
    the engine's thread pool, has answered."""
    deadline = time.monotonic() + timeout_s
    while True:
        run.act()
        row = action(run, action_id)
        if row["state"] != "executing" or "evicted_at" in row["plan"]:
            return row
        assert time.monotonic() < deadline, "the eviction backend did not answer"
        time.sleep(0.01)


def xid(run: Cluster, *ranks: int) -> None:
    for r in ranks:
        run.ranks[r].event("xid", severity="critical", code=79)


def test_an_xid_evicts_its_node_once_and_stops_the_ranks_there(
    cluster: Any, script: Script
) -> None:
    run = cluster(
        evict_policy(script.argv(), max_nodes_fraction_per_hour=0.5),
        world=4,
        per_node=2,
        rules=("FatalXid",),
    )
    run.second(5)
    xid(run, 2, 3)  # both GPUs of node1 fall off the bus: an alert each, one eviction
    (evict,) = run.second()
    assert (evict["kind"], evict["node"], evict["state"], evict["trigger"]) == (
        "evict",
        "node1",
        "executing",
        "rule:FatalXid",
    )
    assert evict["plan"] == {
        "node": "node1",
        "ranks": [2, 3],
        "backend": "command",
        "started_at": run.now,
    }
    evicted = evicting(run, evict["id"])
    args = script.ran("node1")
    assert args is not None, "the backend did not run the script"
    node, reason, ranks, name = args
    assert (node, ranks, name) == ("node1", "2,3", RUN)
    assert reason.startswith("trainwarden: FatalXid rank 2") and "XID 79" in reason
    assert evicted["plan"]["steps"] == [
        " ".join([script.argv()[0], "node1", f"'{reason}'", "2,3", RUN])
    ]
    assert evicted["plan"]["output"] == "drained node1"
    assert [(c["rank"], c["body"]["type"]) for c in commands(run, evict["id"])] == [
        (2, "stop"),
        (3, "stop"),
    ]
    for _ in range(2):
        run.second()
    assert [r.exit_code for r in run.ranks] == [None, None, STOPPED_EXIT_CODE, STOPPED_EXIT_CODE]
    # Their attempts end "stopped": what the agent sends as attempt_end.
    assert [getattr(r, "ended", (None,))[0] for r in run.ranks] == [
        None,
        None,
        "stopped",
        "stopped",
    ]
    assert [r.acks[-1]["reason"] for r in run.ranks[2:]] == [
        "node node1 evicted by trainwarden (rule:FatalXid)"
    ] * 2
    done = action(run, evict["id"])
    assert done["state"] == "done"
    assert done["result"] == {
        "node": "node1",
        "steps": evicted["plan"]["steps"],
        "drained_within_s": 0.0,
        "ranks_stopped": [2, 3],
        "ranks_gone": [],
    }
    assert states(done) == ["proposed", "approved", "executing", "executing", "done"]
    before = run.ranks[0].last_step
    assert run.second() == [done] and run.ranks[0].last_step == before + 1  # node0 trains on


def test_an_eviction_the_backend_refuses_fails_with_its_error(cluster: Any, script: Script) -> None:
    argv = script.argv(code=1, stderr="scontrol: error: Invalid node name specified")
    run = cluster(evict_policy(argv, max_nodes_fraction_per_hour=0.5), rules=("FatalXid",))
    run.second(5)
    xid(run, 1)
    (evict,) = run.second()
    failed = evicting(run, evict["id"])
    assert failed["state"] == "failed" and script.ran("node1") is not None
    assert failed["reason"].startswith("EvictError: `" + argv[0] + " node1 ")
    assert failed["reason"].endswith("` exited 1: scontrol: error: Invalid node name specified")
    assert commands(run, evict["id"]) == []
    assert [e["data"]["action"] for e in events(run.engine, "action_failed")] == [evict["id"]]
    run.second()
    assert [r.exit_code for r in run.ranks] == [None, None]


def test_evictions_wait_out_the_cool_down_and_stop_at_the_blast_radius(
    cluster: Any, script: Script
) -> None:
    run = cluster(
        evict_policy(script.argv(), max_nodes_fraction_per_hour=0.5, cooldown="10m"),
        world=4,
        rules=("FatalXid",),
    )
    run.second(5)
    xid(run, 1)
    (first,) = run.second()
    assert evicting(run, first["id"])["state"] == "executing"
    run.second()
    run.second()
    first = action(run, first["id"])
    assert first["state"] == "done"
    run.tick(60)
    xid(run, 2)
    second = run.second()[-1]
    assert (second["node"], second["state"]) == ("node2", "approved")
    for _ in range(3):
        run.tick(150)
        assert run.act()[-1]["state"] == "approved"  # the cool-down after node1 has not passed
    run.now = first["finished_at"] + 599
    assert run.act()[-1]["state"] == "approved" and script.ran("node2") is None
    run.tick()
    assert run.act()[-1]["state"] == "executing"
    assert evicting(run, second["id"])["plan"]["evicted_at"] == run.now
    assert script.ran("node2") is not None
    xid(run, 3)
    third = run.second()[-1]
    assert (third["node"], third["state"]) == ("node3", "failed")
    expected = (
        "blast-radius guard: evicting node3 would make 3 of the run's 4 nodes "
        "within an hour (limit 50%)"
    )
    assert third["reason"] == expected
    assert script.ran("node3") is None


def test_the_blast_radius_guard_counts_the_run_s_nodes(cluster: Any, script: Script) -> None:
    """25 % of 2 nodes is less than one: one node an hour is always allowed (a bad GPU
    would stall the whole job otherwise), a second is not."""
    run = cluster(evict_policy(script.argv(), cooldown="1m"), rules=("FatalXid",))  # 2 nodes
    run.second(5)
    xid(run, 0)
    (first,) = run.second()
    assert evicting(run, first["id"])["state"] == "executing" and script.ran("node0") is not None
    run.tick(120)
    xid(run, 1)
    second = run.second()[-1]
    assert (second["node"], second["state"]) == ("node1", "failed") and script.ran("node1") is None
    expected = (
        "blast-radius guard: evicting node1 would make 2 of the run's 2 nodes "
        "within an hour (limit 25%)"
    )
    assert second["reason"] == expected


def test_evict_and_rollback_evicts_then_rolls_back_the_job_that_came_back_without_the_node(
    cluster: Any, script: Script
) -> None:
    """One rule, ``action: evict+rollback``: the node goes first; the rollback waits (no
    command sent) until the job is back without it (a new attempt, its ranks live and
    stepping), then restores the clean checkpoint on that attempt's ranks only."""
    policy = {**evict_policy(script.argv(), max_nodes_fraction_per_hour=0.5), **AUTO_ROLLBACK}
    run = cluster(policy, world=4, per_node=2, rules=("FatalXid",))
    both = RULES["FatalXid"].model_copy(update={"action": "evict+rollback"})
    run.alerts = AlertEngine(run.engine, [both])
    for r in run.ranks:
        r.event("attempt_start")
    run.second(25)  # checkpoints at 10 and 20 (rank 0)
    xid(run, 2)
    evict, rollback = run.second()
    assert (evict["kind"], evict["node"], evict["state"]) == ("evict", "node1", "executing")
    assert (rollback["kind"], rollback["state"]) == ("rollback", "approved")
    assert rollback["plan"] == {"after_evict": evict["id"]}
    evicting(run, evict["id"])
    for _ in range(3):
        run.second()
    assert action(run, evict["id"])["state"] == "done"
    # The job is down (a scheduler requeues it): the rollback waits, sending nothing. Its
    # processes are silent for longer than 3 heartbeats (6 s), so that the new ones are
    # taken for a restart (not refused as a second live process: ingest/claims.py).
    for _ in range(7):
        run.tick()
        run.act()
    assert action(run, rollback["id"])["state"] == "approved"
    assert commands(run, rollback["id"]) == []
    # Back on node0 alone: 2 new processes, a new attempt, resumed after step 20.
    run.ranks = [Rank(run, r, "node0", "restore") for r in (0, 1)]
    for r in run.ranks:
        r.process = {"session": f"again-{r.rank}", "started_at": run.now}
        r.next_step = 21
        r._n = 1000  # its events' ids must not repeat the first process's
        r.event("attempt_start")
    run.second(2)
    row = action(run, rollback["id"])
    assert row["state"] == "executing" and row["plan"]["ranks"] == [0, 1], row["history"]
    assert row["plan"]["after_evict"] == evict["id"]
    assert {c["rank"] for c in commands(run, rollback["id"])} == {0, 1}  # not the evicted 2, 3
    done = settle(run, rollback["id"])
    assert done["state"] == "done", done["history"]
    assert [[p.checkpoint_step for p in r.restored] for r in run.ranks] == [[20], [20]]
