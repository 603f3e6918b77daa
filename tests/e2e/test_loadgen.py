"""trainwarden loadgen against a real serve: every simulated rank's rows arrive."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from ..helpers import Server


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_loadgen_rows_all_arrive_and_roll_up(live_server: Server) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainwarden.collector.cli",
            "loadgen",
            "--url",
            live_server.url,
            "--ranks",
            "64",
            "--ranks-per-node",
            "8",
            "--steps-per-s",
            "4",
            "--duration",
            "2",
            "--run",
            "lg",
            "--replay",  # see below
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert "64 ranks on 8 nodes, 8 steps" in result.stdout
    # A refused request (503: on a busy machine a fresh collector's first flush can keep
    # the next requests waiting past the writer's 1 s age rule; CI saw it) is sent again
    # after its Retry-After, as agents do: none may be left unsent.
    unsent = re.search(r"(\d+) rows unsent", result.stdout)
    assert unsent is None or unsent.group(1) == "0", result.stdout
    assert "25 metrics a row" in result.stdout  # 19 built-in + 6 user metrics (the default)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        series = live_server.get("/api/v1/runs/lg/series", metric="step_time").json()
        if series.get("n") == [64] * 8:
            break
        time.sleep(0.3)
    assert series["n"] == [64] * 8
    assert len(live_server.get("/api/v1/runs/lg/ranks").json()) == 64
    user = live_server.get("/api/v1/runs/lg/metrics").json()["user"]
    assert len(user) == 6 and "user.lr" in user
    lr = live_server.get("/api/v1/runs/lg/series", metric="user.lr").json()
    assert lr["n"] == [64] * 8 and lr["min"] == lr["max"]  # one schedule on every rank


def test_the_load_generators_client_reads_chunked_and_sized_answers_on_one_connection() -> None:
    import asyncio
    import concurrent.futures

    from trainwarden.collector.cli.loadgen_http import KeepAliveConnection

    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answers = [
            b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'7\r\n{"error\r\n5\r\n": 1}\r\n0\r\n\r\n',
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
        ]
        for answer in answers:
            head = await reader.readuntil(b"\r\n\r\n")
            seen.append(head)
            length = next(
                int(v)
                for k, _, v in (line.partition(b": ") for line in head.split(b"\r\n"))
                if k.lower() == b"content-length"
            )
            await reader.readexactly(length)
            writer.write(answer)
            await writer.drain()
        writer.close()

    async def main() -> list[tuple[int, bytes]]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = KeepAliveConnection("127.0.0.1", port, timeout_s=5)
        try:
            return [
                await conn.post("/x", b"{}", "X-Trainwarden-Sender: r/0-7\r\n") for _ in range(2)
            ]
        finally:
            conn.close()
            server.close()

    # In a thread of its own: a browser test's Playwright keeps an event loop running in
    # the main thread for the rest of the session, and asyncio.run refuses to nest.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answers = pool.submit(asyncio.run, main()).result(30)
    assert answers == [(503, b'{"error": 1}'), (200, b"{}")]
    assert all(b"X-Trainwarden-Sender: r/0-7\r\n" in head for head in seen)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_loadgen_sample_ids_arrive_with_their_digest_count_and_epoch(
    live_server: Server, db_url: str
) -> None:
    import concurrent.futures

    from sqlalchemy import text

    from trainwarden.agent.samples import summarize
    from trainwarden.agent.values import Captured
    from trainwarden.collector.cli.loadgen import run_loadgen
    from trainwarden.collector.cli.loadgen_bodies import DATASET, sample_columns
    from trainwarden.collector.ingest.samples import unpack
    from trainwarden.collector.store.db import make_engine

    # In a thread of its own: see the test above (asyncio.run and Playwright's loop).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result = pool.submit(
            run_loadgen,
            url=live_server.url,
            ranks=16,
            ranks_per_node=8,
            steps_per_s=4,
            duration_s=1,
            run="lg-ids",
            sample_ids=32,
            replay=True,  # a refused request is sent again, as agents do (see the test above)
        ).result(240)
    assert result.rows_unsent == 0, result.errors
    assert "25 metrics a row and 32 sample ids" in result.summary()
    engine = make_engine(db_url)
    query = text(
        "SELECT d.step, d.rank, d.digest, d.count, d.epoch, d.kept FROM sample_digests d "
        "JOIN runs r ON r.id = d.run_id WHERE r.name = 'lg-ids' ORDER BY d.step, d.rank"
    )
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                rows = conn.execute(query).all()
            if len(rows) == 16 * 4:
                break
            time.sleep(0.3)
    finally:
        engine.dispose()
    assert [(r.step, r.rank) for r in rows] == [(s, k) for s in range(4) for k in range(16)]
    sent = {}
    for r in rows:
        ids = list(unpack(r.kept))
        assert (
            ids
            == sample_columns(world=16, ranks=range(r.rank, r.rank + 1), step=r.step, count=32)[
                "samples_kept"
            ][0]
        )
        assert r.digest == summarize(Captured(tuple(ids)))[0]  # as agents send it
        assert (r.count, r.epoch) == (32, 0)
        sent[r.step, r.rank] = ids
    # A shuffling sampler's batches: each id of the dataset once in its epoch (the 4 x 16
    # x 32 ids are the first of the first epoch), spread over the dataset.
    ids = [i for batch in sent.values() for i in batch]
    assert len(set(ids)) == len(ids) and all(0 <= i < DATASET for i in ids)
    assert max(ids) > DATASET // 2


def test_loadgen_sends_no_samples_columns_by_default() -> None:
    import random

    from trainwarden.collector.cli.loadgen_bodies import node_body

    body = node_body(
        run="r",
        world=16,
        ranks=range(8, 16),
        step=2,
        period_s=1.0,
        sessions={r: "s" for r in range(8, 16)},
        rng=random.Random(0),
        slow_rank=None,
        user=6,
    )
    assert not [name for name in body["steps"] if name.startswith("samples")]


def test_replay_sends_what_was_refused_again_and_merges_what_waited_as_agents_do() -> None:
    """``replay``: a node keeps a refused request (503 with Retry-After) and sends it
    again, oldest first, with the steps done meanwhile behind it; the steps done while
    a request was out go together in the next one. Each row is taken exactly once."""
    import asyncio
    import concurrent.futures

    import orjson

    from trainwarden.collector.cli.loadgen import run_loadgen_async

    taken: list[tuple[int, int]] = []
    tries: dict[str, int] = {}
    steps_a_request: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = next(
                int(v)
                for k, _, v in (line.partition(b": ") for line in head.split(b"\r\n"))
                if k.lower() == b"content-length"
            )
            body = orjson.loads(await reader.readexactly(length))
            sender = next(line for line in head.split(b"\r\n") if b"Sender" in line).decode()
            tries[sender] = tries.get(sender, 0) + 1
            if tries[sender] == 1:  # each node's first request: refused, come back in 1 s
                writer.write(b"HTTP/1.1 503 Busy\r\nRetry-After: 1\r\nContent-Length: 2\r\n\r\n{}")
            else:
                if tries[sender] == 3:
                    # A slow answer while the spool drains: the steps done meanwhile wait
                    # together, behind the refusal (held back, not taken at the first try).
                    await asyncio.sleep(1.2)
                rows = body["steps"]
                taken.extend(zip(rows["rank"], rows["step"], strict=True))
                steps_a_request.append(len(set(rows["step"])))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await run_loadgen_async(
                url=f"http://127.0.0.1:{port}",
                ranks=16,
                ranks_per_node=8,
                steps_per_s=5,
                duration_s=3,
                user_metrics=0,
                replay=True,
            )
        finally:
            server.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # see the test above
        result = pool.submit(asyncio.run, main()).result(60)
    assert sorted(taken) == [(rank, step) for rank in range(16) for step in range(15)]
    assert result.rows == 16 * 15 and result.rows_unsent == 0
    assert result.requests_failed == 2  # each node's first
    # ... and the batches made while they waited, held back behind them
    assert result.requests_replayed > 2
    assert max(steps_a_request) > 1  # steps that waited went in one request
    assert len(result.fresh_s) + len(result.replayed_s) == 2 * 15  # a node's step each
    # Refused at once and resent after 1 s: the first steps are a second late or more.
    assert max(result.replayed_s) >= 1.0 and result.last_taken_s < 3 + 2.5
    # The steps done while the spool drained (through the slow answer) count as held back:
    # those taken at the first try never waited behind it.
    assert result.fresh_s and max(result.fresh_s) < 0.9, sorted(result.fresh_s)[-5:]
