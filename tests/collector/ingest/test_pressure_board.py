"""Collectors on one PostgreSQL tell each other whom they refused and when they fell
behind (``ingest.pressure_board``), so that the leader of a health or alert pass allows
for every collector's pressure, not only its own."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, insert, select

from trainwarden.collector.ingest.limits import Pressure
from trainwarden.collector.ingest.pressure_board import PressureBoard, decode, encode
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import make_engine

from ...helpers import empty_tables


@pytest.fixture
def pg(pg_url: str) -> Iterator[Engine]:
    engine = make_engine(pg_url)
    yield engine
    engine.dispose()
    empty_tables(pg_url)


def rows(engine: Engine) -> dict[str, dict]:
    t = m.collector_pressure.c
    with engine.connect() as conn:
        found = conn.execute(select(m.collector_pressure)).mappings().all()
    return {r[t.collector.name]: dict(r) for r in found}


def test_refused_ranks_travel_as_runs_of_ranks_refused_at_the_same_time() -> None:
    t = 1_795_000_000.0
    node = t + 0.2468  # a node's request: its ranks refused together
    heard = {"run-a": {0: node, 1: node, 2: node, 3: t + 0.9, 7: node}, "run-b": {5: t}}
    spans = encode(heard)
    assert spans == {
        "run-a": [[0, 2, t + 0.24], [3, 3, t + 0.9], [7, 7, t + 0.24]],
        "run-b": [[5, 5, t]],
    }
    back: dict[int, float] = {}
    decode(spans["run-a"], back)
    # Rounded down to 10 ms: a rank is never taken as heard from later than it was.
    assert all(heard["run-a"][r] - 0.01 < at <= heard["run-a"][r] for r, at in back.items())
    assert sorted(back) == [0, 1, 2, 3, 7]
    decode([[0, 1, t + 5], "junk", [9], [4, "x", 1]], back)  # the later time wins; junk skipped
    assert back[0] == back[1] == t + 5 and back[2] < t + 1 and 9 not in back


def test_a_collector_hears_whom_another_refused_and_that_it_fell_behind(pg: Engine) -> None:
    lag_b = [0.0]
    a, b = Pressure(lambda: 0.0), Pressure(lambda: lag_b[0])
    board_a = PressureBoard(pg, a, name="collector-a")
    board_b = PressureBoard(pg, b, name="collector-b")
    board_a.exchange()
    board_b.exchange()
    assert rows(pg) == {}  # neither has anything to say: nothing written
    assert not a.pressed() and a.heard("big-run") == {}

    before = time.time()
    b.refused("big-run/8-15")  # B answered a node's request 503
    lag_b[0] = 2.5  # and its writer is 2.5 s behind
    board_b.exchange()
    board_a.exchange()
    assert set(rows(pg)) == {"collector-b"}  # A, unpressed, writes nothing
    heard = a.heard("big-run")
    assert sorted(heard) == list(range(8, 16))
    assert all(math.floor(before) <= at <= time.time() for at in heard.values())
    # A allows for B's delay as for its own, and for the age of B's news.
    assert a.pressed() and 2.5 <= a.lag_s() < 3.0
    assert a.heard("other-run") == {}
    assert b.heard("big-run").keys() == heard.keys()  # B's own, not read back as another's

    # A refuses rank 3 itself: its answer has both.
    a.refused("big-run/3")
    assert sorted(a.heard("big-run")) == [3, *range(8, 16)]

    # B stops: its row goes, and A forgets B's refusals at its next exchange.
    board_b.stop()
    board_a.exchange()
    assert set(rows(pg)) == {"collector-a"}
    assert sorted(a.heard("big-run")) == [3] and a.lag_s() == 0.0


def test_a_collector_with_nothing_more_to_say_deletes_its_row(pg: Engine) -> None:
    pressure = Pressure(lambda: 0.0, memory_s=0.3)
    board = PressureBoard(pg, pressure, name="collector-c")
    pressure.refused("run/0-7")
    board.exchange()
    [(first, last, at)] = rows(pg)["collector-c"]["heard"]["run"]
    assert (first, last) == (0, 7) and time.time() - 1 < at <= time.time()
    time.sleep(0.4)  # past memory_s: the refusal and the fall behind are forgotten
    board.exchange()
    assert rows(pg) == {}


def test_a_crashed_collectors_row_is_read_while_recent_and_deleted_when_old(pg: Engine) -> None:
    now = time.time()
    t = m.collector_pressure
    with pg.begin() as conn:
        for name, age in (("recent", 5.0), ("old", 60.0), ("ancient", 2 * 86_400.0)):
            conn.execute(
                insert(t).values(
                    collector=name,
                    behind_at=now - age,
                    lag_s=4.0,
                    heard={"run": [[int(age), int(age), int(now - age)]]},
                    updated_at=now - age,
                )
            )
    pressure = Pressure(lambda: 0.0)  # memory_s 30
    PressureBoard(pg, pressure, name="reader").exchange()
    assert sorted(pressure.heard("run")) == [5]  # the old one is past memory_s
    assert pressure.pressed()
    # A row 5 s old: its collector stopped saying (crashed); its delay is not a delay now.
    assert pressure.lag_s() == 0.0
    assert set(rows(pg)) == {"recent", "old"}  # the ancient row is deleted


def test_the_age_of_another_collectors_news_counts_as_a_delay(pg: Engine) -> None:
    """Until the next read, a rank another collector refused since may not be known
    here: the leader allows for how old what it read is."""
    a, b = Pressure(lambda: 0.0), Pressure(lambda: 0.0)
    board_a = PressureBoard(pg, a, name="collector-a")
    b.refused("run/0-7")
    PressureBoard(pg, b, name="collector-b").exchange()
    board_a.exchange()
    first = a.lag_s()
    time.sleep(0.3)
    assert 0.3 <= a.lag_s() - first < 0.6  # B said it 0.3 s longer ago
    b.refused("run/8-15")  # not written yet: A still reads the old news
    assert sorted(a.heard("run")) == list(range(8))
