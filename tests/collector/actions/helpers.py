"""The action engine's tests share a simulated training run on a real database (SQLite
and PostgreSQL), with a controlled clock.

Ranks are simulated the way a collector sees them: each reports its steps and events
through ``ingest`` and takes its commands from the ingest answer (``CommandBoard.take``),
and handles them with the agent's own code (``agent/commands.py``) at step boundaries,
so the acknowledgements are the ones a real rank sends."""

from __future__ import annotations

import math
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

from trainwarden.agent.commands import Commands, RollbackPlan
from trainwarden.alerts import load_rule_packs
from trainwarden.collector.actions.commands import CommandBoard
from trainwarden.collector.actions.engine import ActionEngine
from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.alerting.engine import AlertEngine
from trainwarden.collector.app import create_app
from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import batch

T0 = 1_700_000_000.0
RUN = "r1"
RULES = {r.name: r for r in load_rule_packs()}
AUTO_ROLLBACK = {"rollback": {"mode": "auto", "margin_steps": 2, "skip_margin_steps": 5}}


# -- a training run, as the collector sees it ------------------------------------------


class Rank:
    """One rank: trains, reports a checkpoint every 10 steps (rank 0, as trainers do), and
    handles its commands with the agent's own code (``Commands``) between steps. Having
    answered a rollback's prepare, it holds at its next step boundary until the decision
    arrives, as the agent does (it polls the collector meanwhile: here, the next
    ``exchange``), then trains on to the barrier the commit names. ``handler``: what
    its ``tw.on_rollback`` does, ``"restore"`` or ``"raise"``; ``None``: it has none."""

    def __init__(self, run: Cluster, rank: int, node: str, handler: str | None) -> None:
        self.run, self.rank, self.node, self.handler = run, rank, node, handler
        self.commands = Commands(self, decision_timeout_s=0.0)  # type: ignore[arg-type]
        self._last_step: int | None = None
        self.next_step = 1
        self.steps: list[dict[str, Any]] = []  # recorded, not yet sent
        self.events: list[dict[str, Any]] = []
        self.acks: list[dict[str, Any]] = []  # every command_ack it sent, in order
        self.restored: list[RollbackPlan] = []
        self.exit_code: int | None = None
        self.bad = False  # its weights hold the spiked update
        self.spiked = False  # (a drill's spike comes once; the replay skips its data)
        self.silent = False  # sends nothing and hears nothing (a partitioned host)
        self._prepares: dict[int, int] = {}  # prepare command id -> attempt
        self._armed: tuple[int, int] | None = None  # (action, attempt), from its own ack
        self._decided: set[tuple[int, int]] = set()  # (action, attempt): commit or abort came
        self._held: int | None = None  # the step it holds after
        self._n = 0
        self.process: dict[str, Any] = {}  # a restarted process's session and started_at
        if handler is not None:
            self.commands.on_rollback(self._on_rollback)

    # -- the part of trainwarden.agent.core.Agent that Commands uses

    def event(
        self, kind: str, *, step: int | None = None, severity: str = "info", **data: Any
    ) -> None:
        self._n += 1
        self.events.append(
            {
                "id": f"{self.rank}-{self._n}-{kind}",
                "kind": kind,
                "ts": self.run.now,
                "step": step,
                "severity": severity,
                "data": data,
            }
        )
        if kind == "command_ack":
            self.acks.append(data)
            if data.get("armed"):
                self._armed = (data["action"], self._prepares[data["command"]])
            elif data["command"] in self._prepares and data["phase"] != "prepare":
                self._armed = None  # decided (commit, abort, timeout)

    def flush_soon(self) -> None: ...

    def poll_soon(self) -> None: ...

    def shutdown(self, timeout_s: float = 0.0) -> None: ...

    def end_reason(self, reason: str, detail: str = "", exit_code: int | None = None) -> None:
        self.ended = (reason, detail, exit_code)  # the agent sends it as attempt_end

    # -- the trainer

    @property
    def last_step(self) -> int | None:
        return self._last_step

    def _on_rollback(self, plan: RollbackPlan) -> None:
        if self.handler == "raise":
            raise RuntimeError(f"cannot read {plan.checkpoint_path}")
        self.restored.append(plan)
        self.next_step = plan.checkpoint_step + 1
        self.bad = self.run.saved_bad.get(plan.checkpoint_step, False)  # the weights it holds

    def train(self, until: int, *, nan_at: int | None = None) -> None:
        """Steps up to ``until``. Returns early while it holds for a decision, after a
        rollback (the next call goes on from the checkpoint), or when a stop ends the
        process."""
        restored = len(self.restored)
        while self.exit_code is None and len(self.restored) == restored:
            if self._held is not None:
                if self._armed is not None and self._armed not in self._decided:
                    return  # still waiting for the decision
                n, self._held = self._held, None
                self._boundary(n)
                continue
            if self.next_step > until:
                return
            n, self.next_step = self.next_step, self.next_step + 1
            loss = math.nan if n == nan_at else 2.0 - n / 100
            if self.run.spike_update is not None:  # the loss of step n: weights after update n - 1
                loss = (1.0 + 100 / (n + 100)) * (1000.0 if self.bad else 1.0)
                if n == self.run.spike_update and not self.spiked:  # this step's update, once
                    self.bad = self.spiked = True
            self.steps.append({"step": n, "ts": self.run.now, "duration_s": 0.1, "loss": loss})
            self._last_step = n
            if self.rank == 0 and n % 10 == 0:
                self.run.saved_bad[n] = self.bad or n in self.run.corrupt
                self.event("checkpoint", step=n, path=f"/ckpt/step-{n}.pt")
            if self._armed is not None and self._armed not in self._decided:
                self._held = n
            elif self.commands.pending:
                self._boundary(n)

    def give_up(self) -> None:
        """Its wait for the decision times out (the agent's ``decision_timeout_s``)."""
        assert self._held is not None, "it does not hold"
        n, self._held = self._held, None
        self._boundary(n)

    def _boundary(self, n: int) -> None:
        try:
            self.commands.at_boundary(n)
        except SystemExit as exc:  # a stop command: the process ends here, flushing first
            self.exit_code = int(str(exc.code))

    def exchange(self) -> list[dict[str, Any]]:
        """One ingest request: what the rank recorded goes in, its commands come back."""
        if self.silent or (self.exit_code is not None and not (self.steps or self.events)):
            return []
        body = batch(
            RUN,
            rank=self.rank,
            world_size=len(self.run.ranks),
            steps=self.steps,
            events=self.events,
        )
        body["agent"].update(
            **self.process,
            node=self.node,
            heartbeat_s=2.0,
            sent_at=self.run.now,
            last_step=self._last_step,
            last_step_end=self.run.now,
        )
        self.steps, self.events = [], []
        with write(self.run.engine) as conn:
            ingest(conn, batch=IngestBatch.model_validate(body), now=self.run.now)
            self.run.board.refresh(conn)
            commands = self.run.board.take(conn, RUN, self.rank, self.run.now)
        if self.exit_code is None:
            for c in commands:
                if c.get("phase") == "prepare":
                    self._prepares[c["id"]] = c["attempt"]
                elif c.get("phase") in ("commit", "abort"):
                    self._decided.add((c["action"], c["attempt"]))
            self.commands.receive(commands)
        return commands


class Cluster:
    """A run of ``world`` ranks (``per_node`` to a node), the alert engine with ``rules``
    and the action engine with ``policy``, all on one controlled clock.

    ``verify``: the action engine knows the rules too, so a rollback checks its result
    on the steps run again (else it is done once every rank restored: the protocol tests
    below); steps are rolled up every second, as the rollup worker does.
    ``spike_update``: the update of that step is spiked; every later step's loss is
    1000x until a rank restores a checkpoint saved before it (or one in ``corrupt``)."""

    def __init__(
        self,
        engine: Any,
        policy: dict[str, Any] | None = None,
        *,
        world: int = 2,
        per_node: int = 1,
        handlers: dict[int, str | None] | None = None,
        rules: tuple[str, ...] = ("NonFiniteLoss", "ActionFailed"),
        verify: bool = False,
        spike_update: int | None = None,
        corrupt: tuple[int, ...] = (),
    ) -> None:
        self.engine = engine
        self.now = T0
        self.board = CommandBoard()
        self.policy = ActionPolicy.model_validate(policy or {})
        self.verify = verify
        self.spike_update, self.corrupt = spike_update, set(corrupt)
        self.saved_bad: dict[int, bool] = {}  # checkpoint step -> it holds bad weights
        checked = [RULES[n] for n in rules] if verify else []
        self.actions = ActionEngine(engine, self.policy, board=self.board, rules=checked)
        self.alerts = AlertEngine(engine, [RULES[n] for n in rules])
        handlers = handlers or {}
        self.ranks = [
            Rank(self, r, f"node{r // per_node}", handlers.get(r, "restore")) for r in range(world)
        ]

    def tick(self, seconds: float = 1.0) -> None:
        self.now += seconds

    def train(
        self, until: int, *, ranks: list[int] | None = None, nan_at: int | None = None
    ) -> None:
        for r in self._ranks(ranks):
            r.train(until, nan_at=nan_at)

    def exchange(self, ranks: list[int] | None = None) -> dict[int, list[dict[str, Any]]]:
        return {r.rank: r.exchange() for r in self._ranks(ranks)}

    def _ranks(self, ranks: list[int] | None) -> list[Rank]:
        return self.ranks if ranks is None else [self.ranks[r] for r in ranks]

    def alert(self) -> list[dict[str, Any]]:
        self.alerts.run_once(now=self.now)
        return rows(self.engine, m.alerts)

    def act(self) -> list[dict[str, Any]]:
        self.actions.run_once(now=self.now)
        return rows(self.engine, m.actions)

    def second(self, steps: int = 1) -> list[dict[str, Any]]:
        """A second of the run: each rank trains ``steps`` more steps and flushes, then
        both engines take a pass; the actions after it."""
        self.tick()
        for r in self.ranks:
            r.train(r.next_step - 1 + steps)
        self.exchange()
        if self.verify:
            flush(self.engine, now=self.now, grace_s=0.0)
        self.alert()
        return self.act()

    def spike(self, at: int = 35) -> list[dict[str, Any]]:
        """Train to step ``at`` - 1 (checkpoints at 10, 20, 30), then a NaN loss on every
        rank at step ``at``: the NonFiniteLoss alert of every rank fires (returned)."""
        self.train(at - 1)
        self.exchange()
        self.tick()
        self.train(at, nan_at=at)
        self.exchange()
        self.tick()
        fired = [a for a in self.alert() if a["rule"] == "NonFiniteLoss" and a["state"] == "firing"]
        assert [(a["rank"], a["step"]) for a in fired] == [(r.rank, at) for r in self.ranks]
        return fired

    def api(self) -> TestClient:
        """The collector's HTTP API on this database and policy (no background threads)."""
        app = create_app(
            self.engine,
            ui=False,
            health=None,
            rollups=False,
            alerting=None,
            act=False,
            actions=self.policy,
        )
        return TestClient(app)


def rows(engine: Any, table: Any, **where: Any) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        query = select(table).where(*(table.c[k] == v for k, v in where.items()))
        return [dict(r._mapping) for r in conn.execute(query.order_by(table.c.id))]


def events(engine: Any, kind: str) -> list[dict[str, Any]]:
    return rows(engine, m.events, kind=kind)


def states(action: dict[str, Any]) -> list[str]:
    return [h["state"] for h in action["history"]]


def action(run: Cluster, action_id: int) -> dict[str, Any]:
    (row,) = rows(run.engine, m.actions, id=action_id)
    return row


def commands(run: Cluster, action_id: int) -> list[dict[str, Any]]:
    return rows(run.engine, m.agent_commands, action_id=action_id)


def settle(run: Cluster, action_id: int, seconds: int = 10) -> dict[str, Any]:
    """Seconds of the run until the action has finished."""
    for _ in range(seconds):
        run.second()
        row = action(run, action_id)
        if row["state"] in ("done", "failed", "cancelled"):
            return row
    raise AssertionError(f"action {action_id} still {row['state']}: {row['history']}")


def calm(run: Cluster, minutes: float) -> None:
    """Training goes on without a NaN for ``minutes``: the alerts resolve."""
    run.tick(20)
    run.second()
    run.tick(minutes * 60)
    run.second()
    assert {a["state"] for a in rows(run.engine, m.alerts)} == {"resolved"}
