"""Two collectors on one PostgreSQL: ingest through either, one rollup and one health
verdict per fact (advisory locks), not two."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from trainwarden.agent.wire import SENDER_HEADER, sender

from ..collector.helpers import batch, step
from ..helpers import Server, empty_tables, start_serve, stop_serve


def test_two_collectors_share_one_database(pg_url: str, tmp_path: Path) -> None:
    a = start_serve(pg_url, tmp_path / "a.log")
    b = start_serve(pg_url, tmp_path / "b.log")
    try:
        now = time.time()
        for i in range(20):
            for rank in range(4):
                if rank == 3 and i >= 10:
                    continue  # rank 3 goes silent after step 9
                server = a if rank < 2 else b
                body = batch("shared", rank=rank, world_size=4, steps=[{**step(i), "ts": now + i}])
                body["agent"].update(
                    heartbeat_s=1.0, last_step=i, last_step_end=time.time(), sent_at=time.time()
                )
                assert httpx.post(server.url + "/api/v1/ingest", json=body).status_code == 200
            time.sleep(0.05)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ranks = {r["rank"]: r["state"] for r in a.get("/api/v1/runs/shared/ranks").json()}
            if ranks.get(3) == "dead":
                break
            time.sleep(0.3)
        assert ranks[3] == "dead"
        while time.monotonic() < deadline:  # steps 10+ wait out the grace for rank 3
            series = b.get("/api/v1/runs/shared/series", metric="step_time").json()
            if len(series["step"]) == 20:
                break
            time.sleep(0.3)
        assert series["step"] == list(range(20))
        assert (
            series["n"] == [4] * 10 + [3] * 10
        )  # steps 10+ rolled up after the grace, without rank 3
        dead = [
            e
            for e in a.get("/api/v1/runs/shared/events", kind="rank_state").json()
            if e["rank"] == 3 and e["data"]["to"] == "dead"
        ]
        assert len(dead) == 1  # one evaluator at a time: one verdict, not two
    finally:
        stop_serve(a)
        stop_serve(b)
        empty_tables(pg_url)


def _dead_events(server: Server, run: str) -> list[dict]:
    events = server.get(f"/api/v1/runs/{run}/events", kind="rank_state").json()
    return [e for e in events if e["data"]["to"] == "dead"]


def test_a_rank_another_collector_refuses_is_not_called_dead(pg_url: str, tmp_path: Path) -> None:
    """Past capacity a collector answers 503, and a refused request still says its ranks
    are alive. Both collectors lead health passes in turn (the advisory lock is taken a
    pass at a time), so whichever leads must know whom the other refused: ranks 2 and 3
    send to B, which refuses every request, while A takes ranks 0 and 1; no pass may call
    2 or 3 dead. Once they fall silent everywhere, they are."""
    a = start_serve(pg_url, tmp_path / "a.log")
    b = start_serve(pg_url, tmp_path / "b.log", env={"TRAINWARDEN_MAX_INFLIGHT_INGEST": "1"})
    # B's one ingest slot is held by a request whose body never ends: B refuses the rest.
    at = urlsplit(b.url)
    hold = socket.create_connection((at.hostname, at.port))
    try:
        hold.sendall(
            b"POST /api/v1/ingest HTTP/1.1\r\nhost: b\r\ncontent-type: application/json\r\n"
            b"content-length: 100000\r\n\r\n{"
        )

        def send(server: Server, rank: int, i: int) -> int:
            body = batch("refused", rank=rank, world_size=4, steps=[{**step(i), "ts": time.time()}])
            body["agent"].update(
                heartbeat_s=2.0, last_step=i, last_step_end=time.time(), sent_at=time.time()
            )  # the agents' default heartbeat: dead after 4.5 s without one
            headers = {SENDER_HEADER: sender(body)}
            return httpx.post(server.url + "/api/v1/ingest", json=body, headers=headers).status_code

        i = 0
        for i in range(3):  # every rank taken by A first: the run and its four ranks exist
            assert [send(a, rank, i) for rank in range(4)] == [200] * 4
        time.sleep(0.5)
        refused_until = time.monotonic() + 10  # more than twice the dead threshold
        while time.monotonic() < refused_until:
            i += 1
            assert [send(a, rank, i) for rank in (0, 1)] == [200, 200]
            assert [send(b, rank, i) for rank in (2, 3)] == [503, 503]
            time.sleep(0.4)
        ranks = {r["rank"]: r["state"] for r in a.get("/api/v1/runs/refused/ranks").json()}
        assert ranks == dict.fromkeys(range(4), "healthy")
        assert _dead_events(a, "refused") == []

        # Ranks 2 and 3 fall silent everywhere: dead, as a rank that nobody hears from is.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            i += 1
            assert [send(a, rank, i) for rank in (0, 1)] == [200, 200]
            if {e["rank"] for e in _dead_events(a, "refused")} == {2, 3}:
                break
            time.sleep(0.4)
        assert {e["rank"] for e in _dead_events(a, "refused")} == {2, 3}
    finally:
        hold.close()
        stop_serve(a)
        stop_serve(b)
        empty_tables(pg_url)
