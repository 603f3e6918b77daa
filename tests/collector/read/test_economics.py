"""Run identity, attempts, goodput and the cadence advisor, on SQLite and PostgreSQL."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from trainwarden.collector.app import create_app
from trainwarden.collector.read import economics
from trainwarden.collector.read.economics import EconomicsSettings, advise, optimal_interval, waste
from trainwarden.collector.rollups.worker import flush

from ..economics_scenario import HEARTBEAT_S, economics_body

# -- the advisor: the reference's worked example and the waste formula ---------------------


def test_optimal_interval_reproduces_the_worked_example() -> None:
    # Reference 001 §59.5.2.4: C = 20 s, tau = 7 h "~ 25,000 s" -> sqrt(2*20*25000) = 1000 s.
    assert optimal_interval(20, 25_000) == pytest.approx(1000.0)
    assert optimal_interval(20, 7 * 3600) == pytest.approx(1004.0, abs=0.5)  # 7 h exactly


def test_waste_is_the_reference_formula_and_minimal_at_t_star() -> None:
    c, tau = 20.0, 25_000.0
    assert waste(600, c, tau) == pytest.approx(20 / 600 + (600 + 20) / (2 * 25_000))
    best = optimal_interval(c, tau)
    for t in (best * 0.5, best * 0.9, best * 1.1, best * 2):
        assert waste(t, c, tau) > waste(best, c, tau)
    with pytest.raises(ValueError, match="positive"):
        waste(0, c, tau)


def test_advice_verdicts_and_where_tau_comes_from() -> None:
    s = EconomicsSettings(mtbf_hours=7)
    ok = advise(cost_s=20, interval_s=1200, wall_s=3600, interruptions=0, world_size=8, settings=s)
    assert ok["verdict"] == "ok" and ok["mtbf_s"] == 7 * 3600 and "configured" in ok["mtbf_source"]
    assert ok["waste_now"] == pytest.approx(waste(1200, 20, 7 * 3600))
    rare = advise(
        cost_s=20, interval_s=3 * 3600, wall_s=3600, interruptions=0, world_size=8, settings=s
    )
    assert rare["verdict"] == "too_rare" and rare["ratio"] > 2
    often = advise(cost_s=20, interval_s=60, wall_s=3600, interruptions=0, world_size=8, settings=s)
    assert often["verdict"] == "too_often" and often["waste_now"] > often["waste_optimal"]
    # Two interruptions of its own in 10 h: tau = 5 h, whatever was configured.
    own = advise(
        cost_s=20, interval_s=600, wall_s=36_000, interruptions=2, world_size=8, settings=s
    )
    assert own["mtbf_s"] == 18_000 and "observed" in own["mtbf_source"]
    # Nothing configured: 50,000 GPU-hours per GPU over the job's GPUs.
    default = advise(
        cost_s=20,
        interval_s=600,
        wall_s=60,
        interruptions=0,
        world_size=1000,
        settings=EconomicsSettings(),
    )
    assert default["mtbf_s"] == pytest.approx(50_000 * 3600 / 1000)
    unknown = advise(
        cost_s=None, interval_s=600, wall_s=60, interruptions=0, world_size=8, settings=s
    )
    assert unknown["verdict"] == "unknown" and "blocking save time" in unknown["why"]


# -- a run with a failure and a restart, over HTTP ---------------------------------------------


@pytest.fixture
def client(engine):  # type: ignore[no-untyped-def]
    # No background engines: the cadence test runs the alert engine's pass itself.
    app = create_app(engine, ui=False, health=None, rollups=False, alerting=None, incidents=False)
    with TestClient(app) as c:
        yield c


def _gone() -> None:
    """The processes of the attempt before fall silent past their heartbeat window."""
    time.sleep(5 * HEARTBEAT_S)


def _start(
    session: str, t: float, config: dict[str, Any], *, key: str | None = None, rank: int = 0
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "attempt": key,
        "restart_count": None,
        "config": config,
        "tags": ["baseline"],
        "data_snapshot": "s3://data/v3",
        "code": {"commit": "abc123", "dirty": False},
        "env": {
            "python": "3.11.7",
            "torch": "2.13.0",
            "host": f"host{rank}",
            "world_size": 2,
            "packages_hash": "f" * 64,
        },
    }
    if rank == 0:
        data["packages"] = ["numpy==2.1.0", "torch==2.13.0"]
    return {"id": f"start-{session}", "kind": "attempt_start", "ts": t, "data": data}


def _steps(first: int, last: int, t_first: float) -> list[dict[str, Any]]:
    # A step every 2 s: 1.5 s in the step, 0.5 s between steps (data wait, and saves).
    return [
        {
            "step": n,
            "ts": t_first + 2 * (n - first),
            "duration_s": 1.5,
            "data_wait_s": 0.5,
            "loss": 2.0,
        }
        for n in range(first, last + 1)
    ]


def _post(client: TestClient, body: dict[str, Any]) -> None:
    response = client.post("/api/v1/ingest", json=body)
    assert response.status_code == 200, response.text


def _ckpt(session: str, step: int, ts: float, seconds: float) -> dict[str, Any]:
    return {
        "id": f"ck-{session}-{step}",
        "kind": "checkpoint",
        "ts": ts,
        "step": step,
        "data": {"path": f"/ckpt/{step}", "seconds": seconds, "bytes": 1000},
    }


def test_a_crash_and_a_restart_make_two_attempts_and_a_hand_checked_goodput(
    client: TestClient,
) -> None:
    t0 = time.time() - 200
    config = {"lr": 3e-4, "optim": {"name": "adamw", "betas": [0.9, 0.95]}}
    # Attempt 1: both ranks start at t0, run steps 0..9 (step n at t0 + 10 + 2n); a
    # checkpoint of step 4 takes 0.2 s. Rank 1 dies without a goodbye; torchrun SIGTERMs rank 0.
    for rank in (0, 1):
        s = f"a{rank}"
        _post(client, economics_body("job", rank, s, t0, events=[_start(s, t0, config, rank=rank)]))
        _post(
            client,
            economics_body(
                "job",
                rank,
                s,
                t0,
                steps=_steps(0, 4, t0 + 10),
                events=[_ckpt(s, 4, t0 + 19.5, 0.2)],
            ),
        )
        _post(client, economics_body("job", rank, s, t0, steps=_steps(5, 9, t0 + 20)))
    _post(
        client,
        economics_body(
            "job",
            0,
            "a0",
            t0,
            events=[
                {
                    "id": "end-a0",
                    "kind": "attempt_end",
                    "ts": t0 + 35,
                    "data": {
                        "reason": "sigterm",
                        "detail": "SIGTERM",
                        "exit_code": None,
                        "last_step": 9,
                    },
                }
            ],
        ),
    )
    # Attempt 2 starts at t0 + 40 and resumes from the checkpoint: steps 5..14 from t0 + 50.
    _gone()
    for rank in (0, 1):
        s = f"b{rank}"
        _post(
            client,
            economics_body("job", rank, s, t0 + 40, events=[_start(s, t0 + 40, config, rank=rank)]),
        )
        _post(
            client,
            economics_body(
                "job",
                rank,
                s,
                t0 + 40,
                steps=_steps(5, 14, t0 + 50),
                events=[_ckpt(s, 12, t0 + 65.5, 0.4)],
            ),
        )
    flush(client.app.state.engine, now=time.time(), grace_s=0)

    tries = client.get("/api/v1/runs/job/attempts").json()
    assert [t["number"] for t in tries] == [1, 2]
    first, second = tries
    assert first["state"] == "ended" and first["exit_reason"] == "lost"
    assert first["exit_detail"].startswith("rank 1 on host1 at step 9: ended without a goodbye")
    assert {p["rank"]: p["end_reason"] for p in first["processes"]} == {0: "sigterm", 1: "lost"}
    assert (first["started_at"], first["first_step"], first["last_step"]) == (
        pytest.approx(t0),
        0,
        9,
    )
    assert second["state"] == "running" and second["exit_reason"] is None
    assert (second["first_step"], second["last_step"], second["nodes"]) == (
        5,
        14,
        ["host0", "host1"],
    )

    with client.app.state.engine.connect() as conn:
        got = economics.economics(conn, "job", now=t0 + 80)
    assert got is not None
    g = got["goodput"]
    # By hand. Allocation: 2 GPUs x 40 s (attempt 1) + 2 x 40 s (attempt 2, until now).
    allocation = 2 * 40 + 2 * 40
    kept = 2 * (5 + 10) * 1.5  # steps 0..4 of attempt 1 and 5..14 of attempt 2, both ranks
    replayed = 2 * ((t0 + 20 + 8 + 1.5) - (t0 + 10 + 8 + 1.5))  # end of step 9 - end of step 4
    recovery = 2 * ((t0 + 50) - (t0 + 29.5))  # last step of attempt 1 ended -> next first step
    checkpoint = 2 * (0.2 + 0.4)
    data_wait = 2 * 15 * 0.5 - checkpoint
    assert g["allocation_gpu_s"] == pytest.approx(allocation)
    b = g["breakdown_gpu_s"]
    assert b["kept"] == pytest.approx(kept)
    assert b["replayed"] == pytest.approx(replayed)
    assert b["recovery"] == pytest.approx(recovery)
    assert b["checkpoint"] == pytest.approx(checkpoint)
    assert b["data_wait"] == pytest.approx(data_wait)
    assert b["other"] == pytest.approx(
        allocation - kept - replayed - recovery - checkpoint - data_wait
    )
    assert g["ettr"] == pytest.approx(kept / allocation)
    assert (g["replayed_steps"], g["attempts"], g["interruptions"]) == (5, 2, 1)
    assert g["gpu_hours"]["lost"] == pytest.approx((allocation - kept) / 3600)
    ck = got["checkpoints"]
    assert (ck["count"], ck["interval_steps"], ck["interval_s"]) == (2, 8, pytest.approx(46.0))
    assert ck["blocking_s"] == pytest.approx(0.3) and ck["bytes"] == 1000
    assert got["advisor"]["cost_s"] == pytest.approx(0.3)
    assert got["advisor"]["optimal_interval_s"] == pytest.approx(
        math.sqrt(2 * 0.3 * 50_000 * 3600 / 2)
    )

    # Over HTTP (now = the wall clock): the same shape, a price turns GPU-hours into money.
    client.app.state.settings.price_per_gpu_hour = 2.0
    over_http = client.get("/api/v1/runs/job/economics").json()
    assert 0 < over_http["goodput"]["ettr"] < kept / allocation  # more wall time has passed
    assert over_http["goodput"]["cost"]["used"] == pytest.approx(
        over_http["goodput"]["gpu_hours"]["used"] * 2
    )


def test_identity_packages_and_the_diff_of_two_runs(client: TestClient) -> None:
    t = time.time() - 50
    for run, lr in (("base", 3e-4), ("hot", 1e-3)):
        config = {"lr": lr, "optim": {"name": "adamw"}, "batch": 256}
        _post(client, economics_body(run, 0, f"{run}-0", t, events=[_start(f"{run}-0", t, config)]))
        _post(
            client,
            economics_body(run, 1, f"{run}-1", t, events=[_start(f"{run}-1", t, config, rank=1)]),
        )
    ident = client.get("/api/v1/runs/base/identity").json()
    assert ident["config"] == {"lr": 3e-4, "optim": {"name": "adamw"}, "batch": 256}
    assert ident["code"]["commit"] == "abc123" and ident["env"]["torch"] == "2.13.0"
    assert ident["tags"] == ["baseline"] and ident["data_snapshot"] == "s3://data/v3"
    assert client.get("/api/v1/runs/base/packages").json() == ["numpy==2.1.0", "torch==2.13.0"]
    d = client.get("/api/v1/runs/base/diff/hot").json()
    assert d["config"] == [{"key": "lr", "a": 3e-4, "b": 1e-3}]
    assert d["env"] == [] and d["code"] == [] and d["identical"] is False
    assert d["packages"] == {"added": [], "removed": [], "changed": []}
    same = client.get("/api/v1/runs/base/diff/base").json()
    assert same["identical"] is True
    missing = client.get("/api/v1/runs/base/diff/nope")
    assert missing.status_code == 404 and "nope" in missing.text
    assert client.get("/api/v1/runs/nope/identity").status_code == 404
    assert client.get("/api/v1/runs/base/identity", params={"attempt": 0}).status_code == 422


def test_launcher_keys_group_processes_and_a_replayed_start_changes_nothing(
    client: TestClient,
) -> None:
    t = time.time() - 50
    for rank in (0, 1):  # restart 0 of a torchelastic job, then restart 1
        _post(
            client,
            economics_body(
                "te",
                rank,
                f"x{rank}",
                t,
                events=[_start(f"x{rank}", t, {}, key="torchelastic:j:0", rank=rank)],
            ),
        )
    _gone()
    for rank in (0, 1):
        _post(
            client,
            economics_body(
                "te",
                rank,
                f"y{rank}",
                t + 5,
                events=[_start(f"y{rank}", t + 5, {}, key="torchelastic:j:1", rank=rank)],
            ),
        )
    _post(
        client,
        economics_body(
            "te", 0, "y0", t + 5, events=[_start("y0", t + 5, {}, key="torchelastic:j:1")]
        ),
    )
    tries = client.get("/api/v1/runs/te/attempts").json()
    assert [(t_["number"], t_["key"], len(t_["processes"])) for t_ in tries] == [
        (1, "torchelastic:j:0", 2),
        (2, "torchelastic:j:1", 2),
    ]
    # A clean goodbye from every process: the attempt completed.
    for rank in (0, 1):
        _post(
            client,
            economics_body(
                "te",
                rank,
                f"y{rank}",
                t + 5,
                events=[
                    {
                        "id": f"end-y{rank}",
                        "kind": "attempt_end",
                        "ts": t + 9,
                        "data": {
                            "reason": "completed",
                            "detail": "",
                            "exit_code": 0,
                            "last_step": None,
                        },
                    }
                ],
            ),
        )
    last = client.get("/api/v1/runs/te/attempts").json()[-1]
    assert (last["state"], last["exit_reason"]) == ("ended", "completed")


def test_a_run_without_identity_events_still_answers(client: TestClient) -> None:
    t = time.time() - 20
    _post(client, economics_body("old", 0, "o0", t, steps=_steps(0, 3, t), world=1))
    flush(client.app.state.engine, now=time.time(), grace_s=0)
    assert client.get("/api/v1/runs/old/attempts").json() == []
    econ = client.get("/api/v1/runs/old/economics").json()
    assert econ["goodput"]["breakdown_gpu_s"]["kept"] == pytest.approx(4 * 1.5)
    assert econ["checkpoints"]["count"] == 0 and econ["advisor"]["verdict"] == "unknown"
    assert client.get("/api/v1/runs/nope/economics").status_code == 404


def test_the_cadence_rule_fires_on_a_run_that_checkpoints_too_rarely(client: TestClient) -> None:
    from trainwarden.alerts import load_rule_packs
    from trainwarden.collector.alerting.engine import AlertEngine

    engine = client.app.state.engine
    t0 = time.time() - 4 * 3600
    # Saves of 20 s every hour on 2 GPUs; tau = 7 h configured: T* = sqrt(2*20*25200) = 1004 s.
    events = [_ckpt("c0", n * 1000, t0 + n * 3600, 20.0) for n in range(1, 5)]
    _post(client, economics_body("slow-saves", 0, "c0", t0, steps=_steps(0, 3, t0), events=events))
    flush(engine, now=time.time(), grace_s=0)
    rule = next(r for r in load_rule_packs() if r.name == "CheckpointCadence")
    alerts = AlertEngine(engine, [rule.model_copy(update={"for_": rule.for_.__class__(0, "s")})])
    alerts.economics = EconomicsSettings(mtbf_hours=7)
    alerts.run_once()
    with engine.connect() as conn:
        from trainwarden.collector.store import models as m

        fired = conn.execute(m.alerts.select()).mappings().all()
    assert [(a["rule"], a["state"], a["severity"]) for a in fired] == [
        ("CheckpointCadence", "firing", "info")
    ]
    assert fired[0]["value"] == pytest.approx(3600 / math.sqrt(2 * 20 * 7 * 3600))
    assert "save more often" in fired[0]["annotations"]["description"]


def test_an_attempts_first_step_stored_before_its_start_event_is_still_its_first(
    client: TestClient,
) -> None:
    """A resumed process's first steps can be stored a request before its attempt_start
    (a relay's merged request, a batch that overtook another): the attempt's first step
    is still the lowest it ran, not that of the first request after the event (CI saw
    21 for 20 on a resumed Hugging Face job)."""
    t0 = time.time() - 100
    config = {"lr": 3e-4}
    for rank in (0, 1):
        s = f"a{rank}"
        _post(client, economics_body("job", rank, s, t0, events=[_start(s, t0, config, rank=rank)]))
        _post(client, economics_body("job", rank, s, t0, steps=_steps(0, 4, t0 + 10)))
    _gone()
    for rank in (0, 1):
        s = f"b{rank}"
        _post(client, economics_body("job", rank, s, t0 + 40, steps=_steps(5, 6, t0 + 50)))  # first
        _post(
            client,
            economics_body("job", rank, s, t0 + 40, events=[_start(s, t0 + 40, config, rank=rank)]),
        )
        _post(client, economics_body("job", rank, s, t0 + 40, steps=_steps(7, 9, t0 + 54)))
    flush(client.app.state.engine, now=time.time(), grace_s=0)
    tries = client.get("/api/v1/runs/job/attempts").json()
    assert [(t["number"], t["first_step"], t["last_step"]) for t in tries] == [(1, 0, 4), (2, 5, 9)]
    # Each session was answered: none is kept waiting for its attempt row (a session
    # found after a miss used to keep its count of misses for the collector's lifetime).
    from trainwarden.collector.ingest import attempts

    assert attempts._waiting.get(client.app.state.engine) == {}
