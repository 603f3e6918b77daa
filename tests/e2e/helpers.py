"""What the end-to-end tests share: the rollback drill's collector (its rules and action
policy) and ranks, which other drills and the integrations reuse; events and processes;
the relay's request bodies; the browser tests' screenshots."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from trainwarden.alerts.loading import DEFAULT_RULES

from .. import warm
from ..helpers import Server, start_serve
from ..net import free_port
from .launch import finished_action

RESUMED = "ResumedFromSuspectCheckpoint"
# LossSpike for a drill of a hundred steps: the pack's baseline rule needs hundreds of
# steps of history; this one fires on the agent's own spike flags (loss or grad norm
# far over their running means), at once.
# The shipped ResumedFromSuspectCheckpoint rides along, as in the default pack: a restart
# that loads what a rollback undid rolls back again.
RULES = """\
rules:
  - name: LossSpike
    kind: event
    summary: The loss or the gradient norm spiked (drill rule, on the agent's flags).
    params: {match: flag, flags: [loss_spike, grad_norm_spike]}
    keep_firing_for: 30s
    severity: critical
    runbook: LossSpike.md
    action: rollback
""" + "".join(
    "  " + line + "\n"
    for line in yaml.safe_dump(
        [r for r in yaml.safe_load(DEFAULT_RULES.read_text())["rules"] if r["name"] == RESUMED]
    ).splitlines()
)


ACTIONS = """\
rollback:
  mode: auto
  margin_steps: 2
  skip_margin_steps: 5
"""


STEPS = 110


def demo_ranks(
    server: Server,
    run: str,
    *,
    world: int,
    drill: str,
    steps: int,
    work_ms: float,
    logs: Path,
    batch_size: int = 32,
    env: dict[str, str] | None = None,
    per_rank: Callable[[int], dict[str, str]] | None = None,
    trainer_args: tuple[str, ...] = (),
) -> list[warm.Process]:
    """``world`` ranks of the demo trainer in DDP over gloo, each with the environment
    torchrun would give it (``env`` added, ``per_rank(rank)`` over it), forked warm
    (tests/warm.py); each rank's output in ``logs/<run>-rank<N>.log``."""
    port = free_port()
    procs = []
    for rank in range(world):
        environ = {
            **os.environ,
            **(env or {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "TRAINWARDEN_DRILL": drill,
            "TRAINWARDEN_FLUSH_INTERVAL": "0.5",
            "TRAINWARDEN_PROFILE_EVERY": "0",
            **(per_rank(rank) if per_rank else {}),
        }
        cmd = [
            sys.executable,
            "-m",
            "trainwarden.agent.demo_trainer",
            "--run-name",
            run,
            "--url",
            server.url,
            "--steps",
            str(steps),
            "--work-ms",
            str(work_ms),
            "--batch-size",
            str(batch_size),
            *trainer_args,
        ]
        log = (logs / f"{run}-rank{rank}.log").open("w")
        procs.append(warm.popen(cmd, env=environ, stdout=log, stderr=subprocess.STDOUT))
    return procs


def launch(
    server: Server,
    run: str,
    world: int,
    ckpt: Path,
    logs: Path,
    env: dict[str, str] | None = None,
    *,
    drill: str = "loss_spike=50x@step=35",
    steps: int = STEPS,
    work_ms: int = 80,
    checkpoint_every: int = 10,
    trainer_args: tuple[str, ...] = (),
) -> list[warm.Process]:
    """The rollback drill's ranks: the demo trainer saving a checkpoint every
    ``checkpoint_every`` steps in ``ckpt``."""
    return demo_ranks(
        server,
        run,
        world=world,
        drill=drill,
        steps=steps,
        work_ms=work_ms,
        logs=logs,
        env=env,
        trainer_args=(
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            str(checkpoint_every),
            *trainer_args,
        ),
    )


def serve_with_rollback(db_url: str, tmp_path: Path) -> Server:
    """``trainwarden serve`` with the drill's LossSpike rule and an auto rollback policy."""
    rules, actions = tmp_path / "rules.yaml", tmp_path / "actions.yaml"
    rules.write_text(RULES)
    actions.write_text(ACTIONS)
    return start_serve(
        db_url,
        tmp_path / "serve.log",
        env={
            "TRAINWARDEN_RULES": str(rules),
            "TRAINWARDEN_DEFAULT_RULES": "0",
            "TRAINWARDEN_ACTIONS": str(actions),
        },
    )


def rolled_back(
    server: Server, run: str, world: int, procs: list[warm.Process], logs_dir: Path
) -> tuple[dict[str, Any], int, dict[int, str]]:
    """Once the ranks have exited 0: the done rollback, its barrier step and the ranks'
    logs; every rank restored the same checkpoint after the same step, at most 2 steps
    after the command reached it."""
    codes = [p.wait(300) for p in procs]
    logs = {r: (logs_dir / f"{run}-rank{r}.log").read_text() for r in range(world)}
    assert codes == [0] * world, logs
    action = finished_action(server, run)
    assert action["state"] == "done", action
    assert (action["kind"], action["trigger"], action["mode"]) == (
        "rollback",
        "rule:LossSpike",
        "auto",
    )
    per_rank = action["result"]["ranks"]
    assert sorted(per_rank) == [str(r) for r in range(world)]
    barriers = {r["barrier_step"] for r in per_rank.values()}
    restored = {r["checkpoint_step"] for r in per_rank.values()}
    assert len(barriers) == 1 and restored == {30}, per_rank  # the same step and checkpoint
    assert action["result"]["steps_after_command"] <= 2, action["result"]
    return action, barriers.pop(), logs


def events(server: Server, run: str, kind: str) -> list[dict]:
    response = server.get(f"/api/v1/runs/{run}/events", kind=kind)
    return response.json() if response.status_code == 200 else []


def stop(procs: list[warm.Process]) -> list[int | None]:
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.wait() for p in procs]


def relay_batch(run: str, rank: int, step: int, **step_fields: Any) -> dict[str, Any]:
    now = time.time()
    agent = {"rank": rank, "world_size": 4, "host": "n1", "session": f"s{rank}", "sent_at": now}
    steps = [{"step": step, "ts": now - 0.5, "duration_s": 0.5, "loss": 2.0, **step_fields}]
    return {"run": run, "agent": agent, "steps": steps}


def post_together(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """Post the bodies at once, as a node's agents do, each on its own connection."""
    answers: list[Any] = [None] * len(bodies)

    def post(i: int) -> None:
        answers[i] = httpx.post(url + "/api/v1/ingest", json=bodies[i], timeout=30)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def screenshot(page: Any, name: str) -> None:
    if os.environ.get("TRAINWARDEN_SCREENSHOTS"):
        page.wait_for_timeout(500)
        page.screenshot(
            path=str(Path(os.environ["TRAINWARDEN_SCREENSHOTS"]) / name), full_page=True
        )
