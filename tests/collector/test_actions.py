"""The action engine on a real database (SQLite and PostgreSQL), with a controlled clock:
policy modes, idempotency, the two-phase rollback and its failures, the retry budget,
evictions through a real command backend, and the operator API.

Ranks are simulated the way a collector sees them: each reports its steps and events
through ``ingest`` and takes its commands from the ingest answer (``CommandBoard.take``),
and handles them with the agent's own code (``agent/commands.py``) at step boundaries,
so the acknowledgements are the ones a real rank sends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from trainwarden.agent.commands import STOPPED_EXIT_CODE, Commands, RollbackPlan
from trainwarden.alerts import load_rule_packs
from trainwarden.collector.actions.commands import CommandBoard
from trainwarden.collector.actions.engine import ActionEngine
from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.actions.records import summary
from trainwarden.collector.actions.rollback_transitions import (
    ENDED_BEFORE_HOLDING,
    ENDED_BEFORE_RESTORING,
)
from trainwarden.collector.alerting.engine import AlertEngine
from trainwarden.collector.api.routes import actions as actions_api
from trainwarden.collector.app import create_app
from trainwarden.collector.incidents.grouping import group
from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from .helpers import batch

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


@pytest.fixture
def cluster(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Makes a :class:`Cluster`; the API's clock is the newest cluster's."""
    made: list[Cluster] = []

    def make(policy: dict[str, Any] | None = None, **kwargs: Any) -> Cluster:
        made.append(Cluster(engine, policy, **kwargs))
        return made[-1]

    monkeypatch.setattr(actions_api, "time", SimpleNamespace(time=lambda: made[-1].now))
    yield make
    for c in made:
        c.actions.stop()


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


# -- policy modes --------------------------------------------------------------------


def test_dry_run_records_the_plan_once_and_does_nothing(cluster: Any) -> None:
    run = cluster()  # no actions file: every kind is dry-run
    run.spike()
    (planned,) = run.act()  # an alert on each rank, one rollback planned
    assert (planned["kind"], planned["mode"], planned["state"], planned["trigger"]) == (
        "rollback",
        "dry-run",
        "done",
        "rule:NonFiniteLoss",
    )
    result = planned["result"]
    assert result["dry_run"] is True and result["problem"] is None
    assert (
        result["would"]
        | {"checkpoint_step": 30, "checkpoint_path": "/ckpt/step-30.pt", "skip_from": 31}
        == result["would"]
    )
    assert states(planned) == ["proposed", "approved", "done"]
    assert (planned["finished_at"], planned["approver"]) == (run.now, None)
    for _ in range(3):  # the alerts keep firing: nothing more is planned, nothing is sent
        assert run.second() == [planned]
    assert rows(run.engine, m.agent_commands) == [] and run.board.runs == set()
    assert all(not r.restored and not r.acks for r in run.ranks)
    (ev,) = events(run.engine, "action")
    assert (
        ev["data"]
        | {"action": planned["id"], "type": "rollback", "state": "done", "mode": "dry-run"}
        == ev["data"]
    )


def test_require_ack_acts_once_its_alert_is_acknowledged(cluster: Any) -> None:
    run = cluster({"rollback": {**AUTO_ROLLBACK["rollback"], "mode": "require-ack"}})
    run.spike()
    (proposed,) = run.act()
    assert (proposed["state"], proposed["mode"], proposed["approver"]) == (
        "proposed",
        "require-ack",
        None,
    )
    for _ in range(3):
        assert [a["state"] for a in run.second()] == ["proposed"]
    assert rows(run.engine, m.agent_commands) == []
    with run.api() as client:
        acked = client.post(f"/api/v1/alerts/{proposed['alert_id']}/ack", json={"by": "ana"})
        assert acked.status_code == 200, acked.text
    (approved,) = run.act()
    assert (approved["state"], approved["approver"]) == ("approved", "ana")
    assert approved["history"][-1] == {
        "at": run.now,
        "state": "approved",
        "by": "ana",
        "detail": "its alert was acknowledged",
    }
    (executing,) = run.act()
    assert executing["state"] == "executing" and executing["plan"]["issued_at_step"] == 38
    assert "barrier_step" not in executing["plan"]  # set at commit, from the ranks' answers
    assert {r for r, cmds in run.exchange().items() if cmds} == {0, 1}


def test_approve_and_cancel_through_the_api(cluster: Any) -> None:
    run = cluster(
        {
            "rollback": {**AUTO_ROLLBACK["rollback"], "mode": "require-ack"},
            "evict": {"mode": "require-ack"},
            "stop": {"mode": "auto"},
        },
        rules=("NonFiniteLoss", "FatalXid"),
    )
    run.ranks[1].event("xid", severity="critical", code=79)
    run.spike()
    rollback, evict = run.act()
    assert (rollback["kind"], evict["kind"], evict["node"]) == ("rollback", "evict", "node1")
    assert (rollback["state"], evict["state"]) == ("proposed", "proposed")
    with run.api() as client:
        url = "/api/v1/actions/{}/{}".format
        cancelled = client.post(
            url(evict["id"], "cancel"), json={"by": "bo", "reason": "known flaky"}
        )
        assert cancelled.status_code == 200, cancelled.text
        body = cancelled.json()
        assert (body["state"], body["reason"], body["finished_at"]) == (
            "cancelled",
            "known flaky",
            run.now,
        )
        assert body["history"][-1] == {
            "at": run.now,
            "state": "cancelled",
            "by": "bo",
            "detail": "known flaky",
        }
        assert client.post(url(evict["id"], "approve"), json={"by": "bo"}).status_code == 409
        # Acknowledging its alert no longer approves it.
        assert (
            client.post(f"/api/v1/alerts/{evict['alert_id']}/ack", json={"by": "bo"}).status_code
            == 200
        )

        assert client.post(url(rollback["id"], "approve"), json={}).status_code == 422
        approved = client.post(url(rollback["id"], "approve"), json={"by": "cy", "reason": "go"})
        assert approved.status_code == 200, approved.text
        assert (approved.json()["state"], approved.json()["approver"]) == ("approved", "cy")
        again = client.post(url(rollback["id"], "approve"), json={"by": "cy"})
        assert again.status_code == 409 and "is approved" in again.json()["detail"]
        run.tick()
        assert [(a["kind"], a["state"]) for a in run.act()] == [
            ("rollback", "executing"),
            ("evict", "cancelled"),
        ]
        late = client.post(url(rollback["id"], "cancel"), json={"by": "cy"})
        assert late.status_code == 409 and "is executing" in late.json()["detail"]
        assert client.post(url(999_999, "cancel"), json={"by": "cy"}).status_code == 404

        # An approved action can still be cancelled before the engine starts it.
        stop = client.post(
            f"/api/v1/runs/{RUN}/actions", json={"kind": "stop", "by": "dee", "reason": "wrong run"}
        ).json()
        assert (stop["state"], stop["approver"]) == ("approved", "dee")
        cancelled = client.post(url(stop["id"], "cancel"), json={"by": "dee"}).json()
        assert (cancelled["state"], cancelled["reason"]) == ("cancelled", "cancelled by dee")
    run.tick()
    assert action(run, stop["id"])["state"] == "cancelled" and commands(run, stop["id"]) == []
    assert commands(run, evict["id"]) == []
    timeline = [(e["data"]["action"], e["data"]["state"]) for e in events(run.engine, "action")]
    assert [t for t in timeline if t[0] == evict["id"]] == [
        (evict["id"], "proposed"),
        (evict["id"], "cancelled"),
    ]
    assert (rollback["id"], "approved") in timeline and (stop["id"], "cancelled") in timeline


# -- rollback ------------------------------------------------------------------------


def test_rollback_restores_every_rank_after_the_same_step(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK)
    run.train(34)
    run.ranks[0].event("checkpoint", step=34, path="/ckpt/step-34.pt")  # within the margin
    alerts = run.spike(at=35)
    run.tick()
    run.ranks[0].event("checkpoint", step=32, path="/ckpt/step-32.pt")  # saved after the onset
    run.exchange([0])
    (rollback,) = run.act()  # one rollback for the alerts of both ranks
    assert (rollback["state"], rollback["mode"], rollback["approver"]) == (
        "executing",
        "auto",
        "policy",
    )
    assert rollback["alert_id"] == alerts[0]["id"] and rollback["trigger"] == "rule:NonFiniteLoss"
    plan = rollback["plan"]
    assert plan["rollback"] == {
        "checkpoint_step": 30,
        "checkpoint_path": "/ckpt/step-30.pt",
        "skip_from": 31,
        "skip_to": 35 + 5,
        "lr_scale": None,
        "reason": "rule:NonFiniteLoss: onset at step 35",
    }
    assert (plan["issued_at_step"], plan["ranks"], plan["attempt"]) == (35, [0, 1], 1)
    assert "barrier_step" not in plan

    run.tick()
    sent = run.exchange()  # each rank answers at once, with the last step it finished ...
    for r in (0, 1):
        (prepare,) = sent[r]
        assert prepare == {
            "id": prepare["id"],
            "type": "rollback",
            "phase": "prepare",
            "action": rollback["id"],
            "attempt": 1,
            "plan": plan["rollback"],
        }
    assert {c["delivered_at"] for c in commands(run, rollback["id"])} == {run.now}
    assert [r.events[-1]["step"] for r in run.ranks] == [35, 35]
    assert [r.acks[-1] for r in run.ranks] == [
        {"command": sent[r][0]["id"], "action": rollback["id"], "phase": "prepare", "armed": True}
        for r in (0, 1)
    ]
    run.train(45)  # ... and holds at its next step boundary
    assert [r.last_step for r in run.ranks] == [36, 36]
    run.exchange()
    (rollback,) = run.act()  # every rank answered: the collector commits, barrier 35 + 1
    plan = rollback["plan"]
    assert rollback["state"] == "executing" and plan["committed_at"] == run.now
    assert (plan["barrier_step"], plan["answered_at_step"], plan["rollback"]["skip_to"]) == (
        36,
        35,
        36 + 5,
    )
    run.tick()
    commits = run.exchange()  # the prepare too: a command is sent until its action is over
    assert [[c["phase"] for c in commits[r]] for r in (0, 1)] == [["prepare", "commit"]] * 2
    assert commits[0][1] | {"barrier_step": 36, "skip_to": 41, "attempt": 1} == commits[0][1]
    run.train(45)  # both restore where they hold, after step 36
    assert [(r.last_step, [p.checkpoint_step for p in r.restored]) for r in run.ranks] == [
        (36, [30])
    ] * 2
    assert [r.restored[0].barrier_step for r in run.ranks] == [36, 36]
    run.exchange()
    (done,) = run.act()
    assert done["state"] == "done" and done["finished_at"] == run.now
    per_rank = done["result"]["ranks"]
    assert {r: (a["barrier_step"], a["checkpoint_step"], a["at"]) for r, a in per_rank.items()} == {
        "0": (36, 30, run.now),
        "1": (36, 30, run.now),
    }
    assert all(0 <= a["seconds"] < 1 for a in per_rank.values())  # how long the handler took
    result = done["result"]
    assert (
        result["restored_within_s"],
        result["steps_after_command"],
        result["steps_after_issue"],
    ) == (1.0, 1, 1)
    assert {c["done_at"] for c in commands(run, done["id"])} == {run.now}
    assert run.exchange() == {0: [], 1: []}  # nothing left to send
    assert states(done) == ["proposed", "approved", "executing", "executing", "done"]

    # The ranks go on from step 31, skipping the data window; the alerts do not act again.
    run.train(50)
    assert [b for b in range(29, 46) if run.ranks[0].commands.should_skip_batch(b)] == list(
        range(31, 42)
    )
    for _ in range(3):
        assert [a["state"] for a in run.second()] == ["done"]
    timeline = [(e["data"]["state"], e["data"].get("detail")) for e in events(run.engine, "action")]
    assert timeline == [
        ("approved", None),
        ("executing", "prepare: every rank holds at its next step (attempt 1)"),
        ("executing", "commit: every rank holds; restore after step 36"),
        ("done", None),
    ]
    assert events(run.engine, "action_failed") == []


def test_an_operator_rollback_while_another_executes_fails_instead_of_racing_it(
    cluster: Any,
) -> None:
    run = cluster(AUTO_ROLLBACK)
    run.spike()
    (rule,) = run.act()
    assert rule["state"] == "executing"
    with run.api() as client:
        made = client.post(
            f"/api/v1/runs/{RUN}/actions",
            json={"kind": "rollback", "by": "ana", "reason": "bad shard", "checkpoint_step": 20},
        )
        assert made.status_code == 201, made.text
    rule, operator = run.act()
    assert (rule["state"], operator["state"]) == ("executing", "failed")
    assert (
        operator["reason"]
        == f"rollback {rule['id']} of this run is executing; not starting a second one"
    )
    assert commands(run, operator["id"]) == []
    assert settle(run, rule["id"])["state"] == "done"


def test_checkpoints_are_listed_good_or_suspect(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK)  # margin_steps 2
    run.train(34)
    run.ranks[0].event(
        "checkpoint", step=34, path="/ckpt/step-34.pt", bytes=123
    )  # within the margin
    run.spike(at=35)
    run.ranks[0].event("checkpoint", step=32, path="/ckpt/step-32.pt")  # saved after the onset
    run.exchange([0])
    with run.api() as client:
        listed = client.get(f"/api/v1/runs/{RUN}/checkpoints").json()
        assert client.get("/api/v1/runs/nope/checkpoints").status_code == 404
    (alert_id,) = {a["id"] for a in rows(run.engine, m.alerts) if a["rank"] == 0}
    why = f"saved before NonFiniteLoss (alert {alert_id}, onset at step 35) cleared"
    assert [(c["step"], c["good"], c["suspect"]) for c in listed] == [
        (10, True, None),
        (20, True, None),
        (30, True, None),
        (34, False, why),
        (32, False, why),
    ]
    assert listed[3] | {"path": "/ckpt/step-34.pt", "rank": 0, "meta": {"bytes": 123}} == listed[3]
    (rollback,) = run.act()  # it restores the newest good one
    assert rollback["plan"]["rollback"]["checkpoint_step"] == 30
    assert settle(run, rollback["id"])["state"] == "done"
    calm(run, minutes=11)  # the anomaly clears: what is saved from now on is good
    run.ranks[0].event("checkpoint", step=60, path="/ckpt/step-60.pt")
    run.exchange([0])
    with run.api() as client:
        listed = client.get(f"/api/v1/runs/{RUN}/checkpoints").json()
    assert (listed[-1]["step"], listed[-1]["good"]) == (60, True), listed


def test_a_rollback_without_a_good_checkpoint_fails_and_pages(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK)
    run.spike(at=11)  # the only checkpoint, step 10, is within the margin of the onset
    (failed,) = run.act()
    assert failed["state"] == "failed" and failed["finished_at"] == run.now
    why = "no checkpoint at or before step 7 (onset 11 - 2 - margin 2); reported: [10]"
    assert failed["reason"] == why
    assert states(failed) == ["proposed", "approved", "failed"]
    assert commands(run, failed["id"]) == []
    (ev,) = events(run.engine, "action_failed")
    assert (ev["severity"], ev["data"]["action"], ev["data"]["detail"]) == (
        "critical",
        failed["id"],
        failed["reason"],
    )
    run.tick()
    paged = [a for a in run.alert() if a["rule"] == "ActionFailed"]
    assert [(a["state"], a["severity"]) for a in paged] == [("firing", "critical")]
    assert "action_failed" in paged[0]["annotations"]["description"]


def test_ranks_that_hear_of_it_at_different_steps_restore_after_the_same_step(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK)
    run.spike()
    (rollback,) = run.act()
    run.tick()
    run.exchange([0])  # rank 0 hears of it after step 35 and holds after 36 ...
    run.train(37)  # ... while rank 1, whose answers are late, trains on to 37
    assert [r.last_step for r in run.ranks] == [36, 37]
    run.exchange()  # rank 1 answers with 37 and holds after 38
    run.train(40)
    assert [r.last_step for r in run.ranks] == [36, 38]
    run.exchange()
    (rollback,) = run.act()
    assert (rollback["plan"]["barrier_step"], rollback["plan"]["answered_at_step"]) == (38, 35)
    run.tick()
    run.exchange()
    run.train(45)  # rank 0 trains on from 36 to the barrier; both restore after step 38
    assert [
        (r.last_step, [(p.barrier_step, p.checkpoint_step) for p in r.restored]) for r in run.ranks
    ] == [
        (38, [(38, 30)]),
        (38, [(38, 30)]),
    ]
    run.exchange()
    (done,) = run.act()
    assert done["state"] == "done" and done["result"]["steps_after_command"] == 3
    assert {a["barrier_step"] for a in done["result"]["ranks"].values()} == {38}


def test_a_rank_that_never_answers_fails_the_rollback_after_its_attempts(cluster: Any) -> None:
    run = cluster(
        {"rollback": {**AUTO_ROLLBACK["rollback"], "attempts": 2, "prepare_timeout": "5s"}}
    )
    run.spike()
    (rollback,) = run.act()
    run.ranks[1].silent = True
    details = []
    for _ in range(20):
        (rollback,) = run.second()
        details = [h["detail"] for h in rollback["history"]]
        if rollback["state"] == "failed":
            break
    assert rollback["state"] == "failed" and rollback["plan"]["attempt"] == 2
    assert rollback["reason"] == "ranks not ready: ranks [1] did not answer within 5s"
    assert [d for d in details if d and d.startswith(("prepare", "aborted"))] == [
        "prepare: every rank holds at its next step (attempt 1)",
        "aborted attempt 1: ranks [1] did not answer within 5s",
        "prepare: every rank holds at its next step (attempt 2)",
    ]
    assert not any(r.restored for r in run.ranks)
    held = run.ranks[0].last_step
    run.second()
    run.second()
    assert run.ranks[0].last_step == held + 1  # it heard the abort and trains on
    assert (
        run.ranks[0].acks[-1] | {"phase": "abort", "applied": False, "decision": "abort"}
        == run.ranks[0].acks[-1]
    )


def test_a_rank_that_stops_holding_aborts_the_attempt_and_the_other_hears_abort(
    cluster: Any,
) -> None:
    run = cluster({"rollback": {**AUTO_ROLLBACK["rollback"], "attempts": 1}})
    run.spike()
    (rollback,) = run.act()
    run.exchange([0])  # rank 1 does not hear of it yet
    run.train(37)
    run.ranks[0].give_up()  # rank 0's wait times out: it trains on without a decision
    assert (
        run.ranks[0].acks[-1]
        | {"phase": "timeout", "applied": False, "decision": "timeout", "barrier_step": 36}
        == run.ranks[0].acks[-1]
    )
    run.exchange()
    run.train(38)  # rank 1 holds after 38
    run.exchange()
    (failed,) = run.act()
    assert failed["state"] == "failed"
    assert (
        failed["reason"] == "ranks not ready: rank 0: stopped holding: no decision within its wait"
    )
    assert len(events(run.engine, "action_failed")) == 1
    # Rank 1 learns of the abort and trains on without waiting out its timeout.
    run.tick()
    run.exchange()
    run.train(45)
    assert [(r.last_step, r.restored) for r in run.ranks] == [(45, []), (45, [])]
    assert (
        run.ranks[1].acks[-1]
        | {"phase": "abort", "applied": False, "decision": "abort", "barrier_step": 38}
        == run.ranks[1].acks[-1]
    )
    run.tick(60)
    run.act()
    assert all(c["done_at"] is not None for c in commands(run, rollback["id"]))
    assert run.exchange() == {0: [], 1: []}


def test_a_rank_without_a_rollback_handler_fails_the_rollback_at_once(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK, handlers={1: None})
    run.spike()
    (rollback,) = run.act()
    done = settle(run, rollback["id"])
    assert done["state"] == "failed" and done["plan"]["attempt"] == 1  # no retry: it cannot work
    assert done["reason"] == "ranks not ready: rank 1: no tw.on_rollback(handler) in this trainer"
    assert not any(r.restored for r in run.ranks)


def test_a_handler_that_raises_fails_the_rollback_naming_the_rank(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK, handlers={1: "raise"})
    run.spike()
    (rollback,) = run.act()
    done = settle(run, rollback["id"])
    assert done["state"] == "failed"
    assert (
        done["reason"] == "rollback not applied: rank 1: RuntimeError: cannot read /ckpt/step-30.pt"
    )
    assert [len(r.restored) for r in run.ranks] == [1, 0]
    (ev,) = events(run.engine, "action_failed")
    assert ev["data"]["detail"] == done["reason"]


def test_a_rank_that_does_not_answer_the_prepare_times_it_out(cluster: Any) -> None:
    run = cluster(
        {"rollback": {**AUTO_ROLLBACK["rollback"], "attempts": 1, "prepare_timeout": "20s"}}
    )
    run.spike()
    (rollback,) = run.act()
    run.ranks[1].silent = True
    for _ in range(20):
        (row,) = run.second()
        assert row["state"] == "executing"
    assert run.ranks[0].last_step == 37  # it answered after step 36 and holds after 37 ...
    (failed,) = run.second()
    assert (failed["state"], failed["finished_at"]) == (
        "failed",
        rollback["plan"]["prepared_at"] + 21,
    )
    assert failed["reason"] == "ranks not ready: ranks [1] did not answer within 20s"
    run.second()
    run.second()
    assert run.ranks[0].last_step == 38  # ... and went on when it heard the abort
    assert run.ranks[0].acks[-1]["decision"] == "abort"


def test_a_rank_that_ends_before_it_holds_fails_the_rollback_at_once(cluster: Any) -> None:
    """The job finished (or a rank died) while the rollback was on its way: it fails at
    the next pass naming the rank, not after the prepare's timeout and its retries (45 s by
    default, CI's fast-step drill ended its wait first), and the others hear the abort."""
    run = cluster(AUTO_ROLLBACK)
    run.spike()
    (rollback,) = run.act()
    ended = run.ranks[1]
    ended.event("shutdown", reason="finished")
    ended.exit_code = 0
    run.tick()
    run.exchange()  # rank 0 hears the prepare and answers; rank 1 says goodbye
    (failed,) = run.act()
    assert (failed["state"], failed["plan"]["attempt"]) == ("failed", 1)
    assert failed["reason"] == f"ranks not ready: rank 1: {ENDED_BEFORE_HOLDING}"
    run.train(40)
    run.exchange()
    run.train(40)
    assert run.ranks[0].last_step == 40  # it heard the abort and trains on
    assert run.ranks[0].acks[-1]["decision"] == "abort"


def test_a_rank_that_ends_before_it_restores_fails_the_rollback_at_once(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK)
    run.spike()
    (rollback,) = run.act()
    run.tick()
    run.exchange()
    run.train(45)  # both hold after step 36
    run.exchange()
    (committed,) = run.act()
    assert "committed_at" in committed["plan"]
    run.ranks[1].silent = True  # killed while holding; the health check calls it dead
    with write(run.engine) as conn:
        conn.execute(
            update(m.ranks).where(m.ranks.c.rank == 1).values(state="dead", state_since=run.now)
        )
    run.tick()
    run.exchange()
    run.train(45)  # rank 0 restores
    run.exchange()
    (failed,) = run.act()
    assert failed["state"] == "failed"
    assert failed["reason"] == f"rollback not applied: rank 1: {ENDED_BEFORE_RESTORING}"


# -- the retry budget ------------------------------------------------------------------


def calm(run: Cluster, minutes: float) -> None:
    """Training goes on without a NaN for ``minutes``: the alerts resolve."""
    run.tick(20)
    run.second()
    run.tick(minutes * 60)
    run.second()
    assert {a["state"] for a in rows(run.engine, m.alerts)} == {"resolved"}


def test_past_the_budget_the_rollback_fails_and_the_run_is_stopped(cluster: Any) -> None:
    run = cluster({"rollback": {**AUTO_ROLLBACK["rollback"], "budget": {"count": 1, "per": "30m"}}})
    run.spike(at=35)
    (first,) = run.act()
    assert settle(run, first["id"])["state"] == "done"
    calm(run, minutes=35)  # past the budget's period: the next rollback is allowed
    run.spike(at=50)
    second = run.act()[-1]
    assert (second["id"], second["state"], second["plan"]["rollback"]["checkpoint_step"]) == (
        first["id"] + 1,
        "executing",
        40,
    )
    assert settle(run, second["id"])["state"] == "done"
    calm(run, minutes=11)
    run.spike(at=65)
    third, stop = run.act()[-2:]
    assert third["state"] == "failed"
    assert third["reason"] == "retry budget spent: 1 rollbacks within 30m; stopping the run instead"
    assert commands(run, third["id"]) == []
    assert [e["data"]["action"] for e in events(run.engine, "action_failed")] == [third["id"]]
    assert (stop["kind"], stop["state"], stop["mode"], stop["trigger"], stop["approver"]) == (
        "stop",
        "approved",
        "auto",
        "budget",
        "policy",
    )
    (stop,) = [a for a in run.act() if a["kind"] == "stop"]
    assert stop["state"] == "executing" and stop["plan"]["ranks"] == [0, 1]
    # Rank 1 crashes before it hears of the stop; rank 0 answers the prepare and holds,
    # and, rank 1 being gone, is told to stop after the step it holds at.
    run.ranks[1].event(
        "shutdown", error="CUDA error: an illegal memory access", severity="critical"
    )
    run.ranks[1].exit_code = 1
    run.tick()
    sent = run.exchange()
    assert [(c["type"], c["phase"]) for c in sent[0]] == [("stop", "prepare")]
    assert sent[0][0]["reason"] == "trainwarden: budget (rollback budget spent)"
    (row,) = [a for a in run.act() if a["kind"] == "stop"]
    assert row["state"] == "executing"  # rank 0 has not answered yet
    (row,) = [a for a in run.second() if a["kind"] == "stop"]
    held = run.ranks[0].last_step
    assert row["plan"]["barrier_step"] == held and run.ranks[0].exit_code is None
    run.exchange([0])  # the commit
    run.second()
    assert [r.exit_code for r in run.ranks] == [STOPPED_EXIT_CODE, 1]
    assert run.ranks[0].last_step == held
    assert run.ranks[0].acks[-1] | {"phase": "stop", "stopped": True} == run.ranks[0].acks[-1]
    stop = action(run, stop["id"])
    assert (stop["state"], stop["result"]) == (
        "done",
        {
            "stopped": [0],
            "already_gone": [1],
            "no_answer": [],
            "barrier_step": held,
            "stopped_after": {"0": held},
        },
    )


def asked_to_stop(run: Cluster) -> Cluster:
    """The run trained 5 steps, and an operator asked for it to stop."""
    run.train(5)
    run.exchange()
    with run.api() as client:
        made = client.post(
            f"/api/v1/runs/{RUN}/actions", json={"kind": "stop", "by": "ana", "reason": "done"}
        )
        assert made.status_code == 201, made.text
    return run


def test_a_stop_of_the_run_ends_every_rank_after_the_same_step(cluster: Any) -> None:
    """Rank 1 hears of the stop a step later than rank 0: each answers with its last
    step and holds; the commit names the newest + 1, rank 0 trains on to it, and both
    stop after it. Stopped one step apart, rank 1 would wait in that step's collective
    for rank 0 until the group's timeout wherever the first exit does not end the job."""
    run = asked_to_stop(cluster({"stop": {"mode": "auto"}}, world=3))
    (stop,) = run.act()
    assert stop["state"] == "executing"
    run.tick()
    run.exchange([0, 2])  # ranks 0 and 2 hear it after step 5
    run.train(6, ranks=[1])  # rank 1 finished step 6 first
    run.exchange([1])
    run.train(8)  # each holds at its next boundary: 6, 7, 6
    assert [r.last_step for r in run.ranks] == [6, 7, 6]
    assert [r.exit_code for r in run.ranks] == [None, None, None]
    run.exchange()
    (stop,) = run.act()
    assert stop["plan"]["barrier_step"] == 7, stop  # rank 1 answered with 6: it holds at 7
    run.exchange()
    run.train(20)
    assert [r.last_step for r in run.ranks] == [7, 7, 7]
    assert [r.exit_code for r in run.ranks] == [STOPPED_EXIT_CODE] * 3
    run.exchange()
    (stop,) = run.act()
    assert (stop["state"], stop["result"]["stopped_after"]) == ("done", {"0": 7, "1": 7, "2": 7})


def test_a_stop_that_a_rank_does_not_answer_stops_each_rank_at_its_next_step(
    cluster: Any,
) -> None:
    run = asked_to_stop(cluster({"stop": {"mode": "auto", "prepare_timeout": "10s"}}))
    run.act()
    run.ranks[1].silent = True  # a partitioned host: hears nothing, says nothing
    run.tick()
    run.exchange()
    run.train(8)
    assert run.ranks[0].last_step == 6  # holds
    run.exchange()
    run.tick(11)
    (stop,) = run.act()
    assert "did not answer within 10s" in stop["history"][-1]["detail"], stop["history"]
    sent = run.exchange()[0]
    assert [(c["type"], c.get("phase")) for c in sent] == [("stop", "abort"), ("stop", None)]
    run.train(9)
    assert (run.ranks[0].exit_code, run.ranks[0].last_step) == (STOPPED_EXIT_CODE, 6)
    run.exchange()
    run.tick(61)  # past STOP_TIMEOUT_S: rank 1 never heard it
    (stop,) = run.act()
    assert (stop["state"], stop["result"]) == (
        "done",
        {"stopped": [0], "already_gone": [], "no_answer": [1]},
    )


def test_rollbacks_that_fail_at_the_ranks_spend_the_budget_too(cluster: Any) -> None:
    """A rollback that reaches the ranks and fails there (a handler that cannot read the
    checkpoint) is an attempt: past the budget the run is stopped, not rolled back forever."""
    run = cluster(
        {"rollback": {**AUTO_ROLLBACK["rollback"], "budget": {"count": 2, "per": "1h"}}},
        handlers={1: "raise"},
    )
    failed = []
    for at in (35, 50):
        run.spike(at=at)
        rollback = run.act()[-1]
        failed.append(settle(run, rollback["id"]))
        calm(run, minutes=11)
    assert [f["state"] for f in failed] == ["failed", "failed"]
    assert all(f["reason"].startswith("rollback not applied: rank 1: RuntimeError") for f in failed)
    run.spike(at=65)
    third, stop = run.act()[-2:]
    assert third["reason"] == "retry budget spent: 2 rollbacks within 1h; stopping the run instead"
    assert (stop["kind"], stop["trigger"]) == ("stop", "budget")


# -- the onset from the data, and a rollback that checks its own result -----------------


CHECKED = ("LossSpike", "ActionFailed")


def spiked_run(
    cluster: Any, *, budget: int = 3, corrupt: tuple[int, ...] = ()
) -> tuple[Cluster, dict[str, Any]]:
    """A run of fast steps (20 a second, an engine pass a second) whose update of step 120
    is spiked, under the default pack's LossSpike and an auto rollback: the seconds until
    the rollback has an outcome, and that action."""
    policy = {"rollback": {**AUTO_ROLLBACK["rollback"], "budget": {"count": budget}}}
    run = cluster(policy, rules=CHECKED, verify=True, spike_update=120, corrupt=corrupt)
    for _ in range(60):
        found = [a for a in run.second(20) if a["kind"] == "rollback"]
        if found and found[0]["state"] in ("done", "failed"):
            return run, found[0]
    raise AssertionError(f"no outcome: {found}")


def test_fast_steps_roll_back_to_a_checkpoint_saved_before_the_spiked_update(cluster: Any) -> None:
    run, done = spiked_run(cluster)
    # The pass that saw the doubled loss ran 20 steps after it began: the onset is the
    # data's (the loss of step 121, computed after the spiked update of step 120).
    (alert,) = [a for a in rows(run.engine, m.alerts) if a["rule"] == "LossSpike"]
    assert (alert["onset_step"], alert["active_since_step"]) == (121, 140)
    assert done["state"] == "done", done["history"]
    plan = done["plan"]["rollback"]
    assert plan["reason"] == "rule:LossSpike: onset at step 121"
    # Clean: saved at or before 121 - 2, less the margin of 2. The checkpoint of step 120
    # holds the spiked update (the onset the engine saw, 140, would have restored 130).
    assert (plan["checkpoint_step"], done["plan"]["onset_step"]) == (110, 121)
    assert done["result"]["check"] == "LossSpike no longer holds on steps 111-115 run again"
    assert [r.bad for r in run.ranks] == [False, False]
    assert states(done)[-3:] == ["executing", "executing", "done"]
    (checking,) = [h for h in done["history"] if "checking" in (h["detail"] or "")]
    expected = (
        "every rank restored the checkpoint of step 110; checking LossSpike on the steps run again"
    )
    assert checking["detail"] == expected
    assert summary("rollback", "done", done["result"], None).endswith(
        "; LossSpike no longer holds on steps 111-115 run again"
    )
    with write(run.engine) as conn:  # the incident engine's pass: the post-mortem's incident
        group(conn, now=run.now, cooldown_s=600.0)
    with run.api() as client:
        found = client.get(f"/api/v1/runs/{RUN}/checkpoints").json()
        entries = client.get(f"/api/v1/runs/{RUN}/timeline").json()["entries"]
        report = client.get(f"/api/v1/runs/{RUN}/postmortem", params={"format": "md"}).text
        (api_alert,) = [a for a in client.get("/api/v1/alerts").json() if a["rule"] == "LossSpike"]
    listed = {c["step"]: c["good"] for c in found}
    assert [s for s, good in listed.items() if not good and s <= 140] == [120, 130, 140]
    assert api_alert["onset_step"] == 121
    # The timeline places the anomaly where it began, before the pass that saw it.
    (began,) = [e for e in entries if e["kind"] == "onset"]
    text = "LossSpike: its condition began at step 121 (seen at step 140)"
    assert (began["step"], began["text"]) == (121, text)
    assert text in report  # the post-mortem's timeline too
    assert events(run.engine, "action_failed") == []


def test_a_restore_that_does_not_bring_the_loss_back_rolls_back_again_to_an_older_checkpoint(
    cluster: Any,
) -> None:
    run, done = spiked_run(cluster, corrupt=(110,))  # the checkpoint of step 110 is bad on disk
    assert done["state"] == "done", done["history"]
    (first,) = done["result"]["restores"]
    assert (first["checkpoint_step"], first["steps"]) == (110, [111, 115])
    assert first["detail"].startswith("run: loss ") and "x its baseline" in first["detail"]
    assert done["plan"]["rollback"]["checkpoint_step"] == 100
    assert done["result"]["check"] == "LossSpike no longer holds on steps 101-105 run again"
    assert [[p.checkpoint_step for p in r.restored] for r in run.ranks] == [[110, 100]] * 2
    assert [r.bad for r in run.ranks] == [False, False]
    again = [h["detail"] for h in done["history"] if h["state"] == "approved"][-1]
    assert again.startswith(
        "the restore of the checkpoint of step 110 did not fix it "
        "(steps 111-115 run again): run: loss"
    )
    assert again.endswith("; rolling back to an older checkpoint")
    text = summary("rollback", "done", done["result"], None)
    assert (
        "restored the checkpoint of step 100" in text
        and "(the restore of step 110 had not fixed it)" in text
    )
    assert events(run.engine, "action_failed") == []


def test_a_rollback_whose_restores_never_bring_the_loss_back_fails_and_pages(cluster: Any) -> None:
    run, failed = spiked_run(cluster, budget=2, corrupt=tuple(range(10, 130, 10)))
    assert failed["state"] == "failed", failed["history"]
    assert [[p.checkpoint_step for p in r.restored] for r in run.ranks] == [[110, 100]] * 2
    assert failed["reason"].startswith(
        "the restore of the checkpoint of step 100 did not fix it "
        "(steps 101-105 run again): run: loss"
    )
    assert failed["reason"].endswith(
        "; retry budget spent: 2 rollbacks within 6h; stopping the run instead"
    )
    (ev,) = events(run.engine, "action_failed")
    assert ev["data"]["detail"] == failed["reason"]
    run.tick()
    paged = [a for a in run.alert() if a["rule"] == "ActionFailed"]
    assert [(a["state"], a["severity"]) for a in paged] == [("firing", "critical")]


def test_stopping_a_run_whose_ranks_have_all_ended_is_done_at_once(cluster: Any) -> None:
    run = cluster({"stop": {"mode": "auto"}})
    run.train(5)
    for r in run.ranks:
        r.event("shutdown", reason="finished")
        r.exit_code = 0
    run.exchange()
    with run.api() as client:
        made = client.post(
            f"/api/v1/runs/{RUN}/actions", json={"kind": "stop", "by": "ana", "reason": "cleanup"}
        )
        assert made.status_code == 201, made.text
    run.tick()
    (stop,) = run.act()
    run.tick()
    (stop,) = run.act()
    assert (stop["state"], stop["result"]) == (
        "done",
        {"stopped": [], "already_gone": [], "no_answer": []},
    )
    assert commands(run, stop["id"]) == []


# -- eviction ---------------------------------------------------------------------------


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


# -- the operator's API ----------------------------------------------------------------


def named(resp: Any) -> str:
    """A 422's summary of what was wrong (``field: message``)."""
    return str(resp.json()["error"])


def test_operator_actions_through_the_api(cluster: Any) -> None:
    run = cluster({**AUTO_ROLLBACK, "stop": {"mode": "auto"}}, world=3)  # evictions: dry-run
    run.train(34)
    run.ranks[2].event("shutdown", reason="finished its shard")  # not live: left out
    run.ranks[2].exit_code = 0
    run.exchange()
    run.tick()
    with run.api() as client:

        def ask(run_name: str = RUN, **body: Any) -> Any:
            body = {"by": "ana", "reason": "bad shard", **body}
            return client.post(f"/api/v1/runs/{run_name}/actions", json=body)

        made = ask(kind="rollback", checkpoint_step=20)
        assert made.status_code == 201, made.text
        rollback = made.json()
        assert (
            rollback
            | {
                "run": RUN,
                "kind": "rollback",
                "state": "approved",
                "mode": "auto",
                "trigger": "operator:ana",
                "approver": "ana",
                "alert_id": None,
                "plan": {"checkpoint_step": 20},
                "reason": "bad shard",
                "created_at": run.now,
            }
            == rollback
        )
        assert [h["state"] for h in rollback["history"]] == ["proposed", "approved"]
        (executing,) = run.act()
        plan = executing["plan"]
        assert (executing["state"], plan["checkpoint_step"], plan["issued_at_step"]) == (
            "executing",
            20,
            34,
        )
        assert plan["ranks"] == [0, 1]
        assert (
            plan["rollback"]
            | {
                "checkpoint_step": 20,
                "checkpoint_path": "/ckpt/step-20.pt",
                "skip_from": 21,
                "reason": "operator:ana: onset at step 34",
            }
            == plan["rollback"]
        )

        # The agent's own ingest request brings its commands back.
        with write(run.engine) as conn:
            client.app.state.commands.refresh(conn)  # type: ignore[attr-defined]
        answer = client.post("/api/v1/ingest", json=batch(RUN, rank=0, world_size=3))
        assert answer.status_code == 200, answer.text
        (prepare,) = answer.json()["commands"]
        assert (
            prepare
            | {"type": "rollback", "phase": "prepare", "action": rollback["id"], "attempt": 1}
            == prepare
        )
        detail = client.get(f"/api/v1/actions/{rollback['id']}").json()
        assert [
            (c["rank"], c["phase"], c["delivered_at"] is not None, c["done_at"])
            for c in detail["commands"]
        ] == [
            (0, "prepare", True, None),
            (1, "prepare", False, None),
        ]
        assert detail["commands"][0]["id"] == prepare["id"]
        assert client.post("/api/v1/ingest", json=batch(RUN, rank=0, world_size=3)).json()[
            "commands"
        ] == [prepare]

        unknown = ask(kind="rollback", checkpoint_step=25).json()
        run.tick()
        assert action(run, unknown["id"])["state"] == "approved"
        run.act()
        unknown = action(run, unknown["id"])
        assert unknown["state"] == "failed"
        assert unknown["reason"] == "no checkpoint of step 25 was reported (known: [10, 20, 30])"

        evict = ask(kind="evict", node="node1").json()
        assert (evict["state"], evict["mode"], evict["result"]) == (
            "done",
            "dry-run",
            {"dry_run": True, "would": {"node": "node1", "backend": None}, "problem": None},
        )
        dry = ask(kind="rollback", dry_run=True).json()
        assert (dry["state"], dry["result"]["would"]["checkpoint_step"]) == ("done", 30)
        stop = ask(kind="stop", rank=1).json()
        run.tick()
        run.act()
        assert [(c["rank"], c["body"]["type"]) for c in commands(run, stop["id"])] == [(1, "stop")]

        cases: list[tuple[dict[str, Any], str]] = [  # what was wrong, named
            ({"kind": "evict", "node": "node9"}, "node: no rank of run 'r1' runs on node 'node9'"),
            ({"kind": "stop", "rank": 7}, "rank: run 'r1' has no rank 7"),
            ({"kind": "evict"}, "body: Value error, an eviction names its node"),
            (
                {"kind": "stop", "checkpoint_step": 3},
                "body: Value error, checkpoint_step is for rollbacks, not a stop",
            ),
            (
                {"kind": "rollback", "checkpoint_step": -1},
                "checkpoint_step: Input should be greater than or equal to 0",
            ),
            (
                {"kind": "rollback", "node": "node1"},
                "body: Value error, node is for evictions, not a rollback",
            ),
            ({"kind": "reboot"}, "kind: Input should be 'rollback', 'evict' or 'stop'"),
            ({"kind": "stop", "force": True}, "force: Extra inputs are not permitted"),
            ({"kind": "stop", "by": ""}, "by: String should have at least 1 character"),
            ({"kind": "stop", "reason": None}, "reason: Input should be a valid string"),
        ]
        for body, problem in cases:
            resp = ask(**body)
            assert (resp.status_code, named(resp)) == (422, problem), body
        assert ask("nope", kind="stop").status_code == 404

        def listed(**params: Any) -> list[tuple[int, str, str]]:
            found = client.get("/api/v1/actions", params=params).json()
            return [(a["id"], a["kind"], a["state"]) for a in found]

        newest_first = [stop["id"], dry["id"], evict["id"], unknown["id"], rollback["id"]]
        assert [a[0] for a in listed()] == newest_first
        assert listed(run=RUN, state="failed") == [(unknown["id"], "rollback", "failed")]
        assert listed(kind="stop") == [(stop["id"], "stop", "executing")]
        assert listed(state=["done", "failed"], kind="rollback") == [
            (dry["id"], "rollback", "done"),
            (unknown["id"], "rollback", "failed"),
        ]
        assert listed(run="other") == []
        assert client.get("/api/v1/actions", params={"state": "lost"}).status_code == 422
        assert client.get("/api/v1/actions/999999").status_code == 404


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
