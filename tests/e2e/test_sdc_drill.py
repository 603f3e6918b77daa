"""Silent data corruption drill on real gloo ranks: one bit of one parameter flipped on
rank 2 of 4 right after its optimizer step 35 (``sdc=bitflip``), replica checks every 10
steps. The collector's comparison finds it at step 40 (the first check after), names
rank 2 and where it diverged (after step 30), SilentDataCorruption fires at once, and
with ``action: rollback`` under an ``auto`` policy every rank restores the checkpoint of
step 30 (never the one saved at 40): the replicas agree again at the next check."""

from __future__ import annotations

from pathlib import Path

from .. import warm
from ..helpers import start_serve, stop_serve, wait_for
from .helpers import launch, stop
from .launch import finished_action

RULES = """\
rules:
  - name: SilentDataCorruption
    kind: event
    summary: A rank's parameters differ from its replicas' (drill rule, rolling back).
    params: {match: event, events: [replica_divergence], per_rank: true}
    keep_firing_for: 1h
    severity: critical
    runbook: SilentDataCorruption.md
    action: rollback
"""
ACTIONS = """\
rollback:
  mode: auto
"""


def test_a_flipped_bit_is_found_at_the_next_check_and_rolled_back_to_a_clean_checkpoint(
    tmp_path: Path,
) -> None:
    rules, actions = tmp_path / "rules.yaml", tmp_path / "actions.yaml"
    rules.write_text(RULES)
    actions.write_text(ACTIONS)
    server = start_serve(
        f"sqlite:///{tmp_path / 'sdc.db'}",
        tmp_path / "serve.log",
        env={
            "TRAINWARDEN_RULES": str(rules),
            "TRAINWARDEN_DEFAULT_RULES": "0",
            "TRAINWARDEN_ACTIONS": str(actions),
        },
    )
    run, world = "sdc4", 4
    procs = launch(
        server,
        run,
        world,
        tmp_path / "ckpt",
        tmp_path,
        drill="sdc=bitflip@rank=2,step=35",
        steps=90,
        work_ms=60,
        trainer_args=("--replica-check-every", "10"),
    )
    try:
        codes = [p.wait(300) for p in procs]
        logs = {r: (tmp_path / f"{run}-rank{r}.log").read_text() for r in range(world)}
        assert codes == [0] * world, logs
        action = finished_action(server, run)
        events = server.get(f"/api/v1/runs/{run}/events", kind="replica_divergence").json()
        alerts = server.get("/api/v1/alerts", run=run).json()
        results = server.get(f"/api/v1/runs/{run}/replicas").json()
        ckpts = server.get(f"/api/v1/runs/{run}/checkpoints").json()
    finally:
        stop(procs)
        stop_serve(server)
    first = events[0]
    assert (first["rank"], first["step"]) == (2, 40), events
    assert first["data"]["last_agreed_step"] == 30
    assert "diverged in steps 31-40" in first["data"]["reason"]
    assert {e["rank"] for e in events} == {2}  # no other rank ever a suspect
    (alert,) = [a for a in alerts if a["rule"] == "SilentDataCorruption"]
    assert alert["rank"] == 2 and alert["annotations"]["clean_through"] == "30"
    fired_after = alert["fired_at"] - first["ts"]
    assert fired_after <= 5, alert
    assert action["state"] == "done", action
    restored = {r["checkpoint_step"] for r in action["result"]["ranks"].values()}
    assert restored == {30}, action["result"]
    # The checkpoint of step 40 saved before the restore holds the flipped bit: suspect;
    # saved again by the steps run after the restore: good.
    restored_at = max(r["at"] for r in action["result"]["ranks"].values())
    assert [c["good"] for c in ckpts if c["step"] == 40 and c["ts"] < restored_at] == [False]
    assert [c["good"] for c in ckpts if c["step"] == 40 and c["ts"] >= restored_at] == [True]
    # The replay's check of step 40, and every later one, agree.
    after = [r for r in results if r["step"] >= 40]
    assert after and all(r["agree"] for r in after), results
    print(
        f"\nrank 2 flipped at step 35: found at step {first['step']} (last agreed "
        f"{first['data']['last_agreed_step']}), alert {fired_after:.1f} s after the "
        f"comparison, restored checkpoint {restored.pop()}"
    )


PROBE_RULES = RULES.replace("action: rollback", "action: none")


def test_wrong_arithmetic_is_found_by_the_determinism_probe_on_that_rank_only(
    tmp_path: Path,
) -> None:
    """``sdc=arith@rank=1,step=20`` with probes every 10 steps: the parameters of the 4
    replicas stay equal (DDP averages the slightly wrong gradient into all of them); the
    probe names rank 1 at step 20 or 30, and SilentDataCorruption fires for rank 1."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(PROBE_RULES)
    server = start_serve(
        f"sqlite:///{tmp_path / 'arith.db'}",
        tmp_path / "serve.log",
        env={"TRAINWARDEN_RULES": str(rules), "TRAINWARDEN_DEFAULT_RULES": "0"},
    )
    run, world = "arith4", 4
    procs = launch(
        server,
        run,
        world,
        tmp_path / "ckpt",
        tmp_path,
        drill="sdc=arith@rank=1,step=20",
        steps=150,  # on long enough for the evaluator and the alert engine's passes
        work_ms=10,
        trainer_args=("--replica-check-every", "10", "--determinism-probe-every", "10"),
    )
    try:
        codes = [p.wait(300) for p in procs]
        logs = {r: (tmp_path / f"{run}-rank{r}.log").read_text() for r in range(world)}
        assert codes == [0] * world, logs
        alerts = wait_for(
            lambda: [
                a
                for a in server.get("/api/v1/alerts", run=run).json()
                if a["rule"] == "SilentDataCorruption"
            ],
            30,
            "the alert",
        )
        events = server.get(f"/api/v1/runs/{run}/events", kind="replica_divergence").json()
        results = server.get(f"/api/v1/runs/{run}/replicas").json()
    finally:
        stop(procs)
        stop_serve(server)
    first = events[0]
    assert first["rank"] == 1 and first["step"] in (20, 30), events
    assert first["data"]["check"] == "probe" and first["data"]["clean_through"] in (10, 20)
    assert {(e["rank"], e["data"]["check"]) for e in events} == {(1, "probe")}
    assert {a["rank"] for a in alerts} == {1}
    by_step = {r["step"]: r for r in results}
    assert sorted(by_step) == list(range(0, 150, 10))
    assert all(r["agree"] for r in results), results  # the parameters never differ
    assert [by_step[s]["probe_suspects"] for s in (0, 10)] == [[], []]
    assert all(by_step[s]["probe_suspects"] == [1] for s in range(30, 150, 10)), results
    print(f"\nrank 1's arithmetic off from step 20: its probe named at step {first['step']}")


def test_an_hsdp_job_is_checked_per_shard_and_a_flip_is_found_in_its_own_group(
    tmp_path: Path,
) -> None:
    """FSDP2 with a replicate dimension (HSDP) on 4 gloo ranks, a 2 x 2 mesh: ranks 0 and 2
    hold one shard, 1 and 3 the other (``tests/e2e/hsdp_worker.py``). Rank 3 flips a bit
    of its shard at step 12: the check of step 15 finds group 1,3 in disagreement (two
    replicas: both suspects, as the design says, until the next checks decide), and
    group 0,2 agrees at every check."""
    import os
    import subprocess
    import sys

    from ..helpers import ROOT
    from ..net import free_port

    server = start_serve(f"sqlite:///{tmp_path / 'hsdp.db'}", tmp_path / "serve.log")
    run, port = "hsdp4", free_port()
    procs = []
    for rank in range(4):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "TRAINWARDEN_URL": server.url,
            "TRAINWARDEN_DRILL": "sdc=bitflip@rank=3,step=12",
        }
        with open(tmp_path / f"rank{rank}.log", "wb") as log:
            procs.append(
                warm.popen(
                    [sys.executable, "-m", "tests.e2e.hsdp_worker", run, "20"],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        codes = [p.wait(180) for p in procs]
        logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(4)]
        assert codes == [0] * 4, logs
        results = wait_for(
            lambda: (
                (got := server.get(f"/api/v1/runs/{run}/replicas").json()) and len(got) == 8 and got
            ),
            30,
            "4 checks of 2 groups compared",
        )
        events = server.get(f"/api/v1/runs/{run}/events", kind="replica_divergence").json()
    finally:
        stop(procs)
        stop_serve(server)
    for r, group in enumerate(["0,2", "1,3", "0,2", "1,3"]):  # the mesh's replicate dim
        assert f"rank {r}: replica group {group}" in logs[r], logs[r]
    by_group: dict[str, list[tuple[int, list[int]]]] = {}
    for r in results:
        by_group.setdefault(r["replica_group"], []).append((r["step"], r["suspects"]))
    assert by_group == {
        "0,2": [(0, []), (5, []), (10, []), (15, [])],
        "1,3": [(0, []), (5, []), (10, []), (15, [1, 3])],
    }
    assert sorted((e["rank"], e["step"], e["data"]["replica_group"]) for e in events) == [
        (1, 15, "1,3"),
        (3, 15, "1,3"),
    ]
    assert {e["data"]["last_agreed_step"] for e in events} == {10}
