"""A stopped run stays stopped when its launcher restarts it
(``collector/actions/stop_restarts.py``), on SQLite and PostgreSQL: an attempt the same
launch begins after a done stop of the run gets a stop of its own; a new launch, a dry
run, a stop of one rank and an attempt of before the stop do not."""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert, select, update

from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.actions.stop_restarts import TRIGGER, stop_restarts
from trainwarden.collector.store import models as m

T0 = 1_700_000_000.0


def setup(engine: Any, keys: list[str | None], *, stop: dict[str, Any] | None = None) -> int:
    """A run with an attempt a key (one every 60 s) and a done stop at T0 + 90 (after the
    second attempt began); ``stop`` changes its columns."""
    with engine.begin() as conn:
        run_id = conn.execute(
            insert(m.runs).values(name="r", world_size=2, created_at=T0, updated_at=T0)
        ).inserted_primary_key[0]
        for number, key in enumerate(keys, start=1):
            conn.execute(
                insert(m.attempts).values(
                    run_id=run_id,
                    number=number,
                    key=key,
                    started_at=T0 + 60 * (number - 1),
                    nodes=[],
                )
            )
        conn.execute(
            insert(m.actions).values(
                {
                    "run_id": run_id,
                    "kind": "stop",
                    "state": "done",
                    "mode": "auto",
                    "trigger": "rule:CrashLoop",
                    "history": [],
                    "created_at": T0 + 80,
                    "updated_at": T0 + 90,
                    "finished_at": T0 + 90,
                    **(stop or {}),
                }
            )
        )
    return int(run_id)


def new_stops(engine: Any, now: float = T0 + 200) -> list[dict[str, Any]]:
    with engine.begin() as conn:
        made = stop_restarts(conn, ActionPolicy(), now=now)
        a = m.actions.c
        return [
            dict(r._mapping)
            for r in conn.execute(select(m.actions).where(a.id.in_(made)).order_by(a.id))
        ]


def test_a_restart_of_the_same_launch_after_a_stop_is_stopped_at_once(engine) -> None:  # type: ignore[no-untyped-def]
    setup(engine, ["torchelastic:abc:0", "torchelastic:abc:1", "torchelastic:abc:2"])
    (made,) = new_stops(engine)
    assert (made["kind"], made["trigger"], made["rank"], made["mode"]) == (
        "stop",
        TRIGGER,
        None,
        "auto",
    )
    assert (made["state"], made["approver"]) == ("approved", "stop #1")
    assert made["history"][0]["detail"] == (
        "attempt 3 was started by the same launch after stop #1 stopped the run"
    )
    assert new_stops(engine) == []  # once an attempt


def test_a_new_launch_is_a_person_starting_the_run_again(engine) -> None:  # type: ignore[no-untyped-def]
    setup(engine, ["torchelastic:abc:0", "torchelastic:abc:1", "torchelastic:new:0"])
    assert new_stops(engine) == []


def test_the_same_rendezvous_id_launched_again_is_a_new_launch(engine) -> None:  # type: ignore[no-untyped-def]
    setup(engine, ["torchelastic:job7:0", "torchelastic:job7:1", "torchelastic:job7:0"])
    assert new_stops(engine) == []  # its count went back to 0: torchrun started anew


def test_a_dry_run_a_rank_stop_a_keyless_launch_or_an_old_stop_leave_restarts_alone(engine) -> None:  # type: ignore[no-untyped-def]
    keys = ["slurm:42:0", "slurm:42:1", "slurm:42:2"]
    setup(engine, keys, stop={"mode": "dry-run"})
    assert new_stops(engine) == []
    with engine.begin() as conn:
        conn.execute(update(m.actions).values(mode="auto", rank=1))
    assert new_stops(engine) == []
    with engine.begin() as conn:
        conn.execute(update(m.actions).values(rank=None))
    assert new_stops(engine, now=T0 + 7 * 3600) == []  # done more than WATCH_S ago
    assert len(new_stops(engine)) == 1  # the Slurm job's requeue
    with engine.begin() as conn:
        conn.execute(update(m.attempts).values(key=None))
        conn.execute(m.actions.delete().where(m.actions.c.trigger == TRIGGER))
    assert new_stops(engine) == []
