"""The hung-collective verdict from the ranks' Flight Recorder rings (pure)."""

from __future__ import annotations

from typing import Any

from trainwarden.collector.health.collectives import analyze, table

T0 = 1_795_730_000.0


def entry(seq: int, *, done: bool, size: int = 1024, op: str = "all_reduce") -> dict[str, Any]:
    return {
        "seq": seq,
        "op": op,
        "in_sizes": [[size]],
        "in_dtypes": ["Float"],
        "out_sizes": [[size]],
        "out_dtypes": ["Float"],
        "state": "scheduled",
        "done": done,
        "created": T0 + seq,
        "started": None,
        "completed": None,
    }


def ring(*groups: dict[str, Any]) -> dict[str, Any]:
    return {
        "trigger": "stalled",
        "request": None,
        "available": True,
        "reason": None,
        "dumped_at": T0 + 100,
        "groups": list(groups),
    }


def group(
    pg: str,
    ranks: list[int],
    last: int,
    *,
    waiting: bool,
    desc: str = "default_pg",
    first: int = 1,
    size: int = 1024,
) -> dict[str, Any]:
    entries = [entry(s, done=True) for s in range(first, last)]
    entries.append(entry(last, done=not waiting, size=size))
    return {
        "pg": pg,
        "desc": desc,
        "ranks": ranks,
        "entries": entries,
        "last_enqueued": None,
        "last_completed": None,
        "dropped": 0,
    }


def test_the_rank_that_never_entered_is_named_with_the_op_and_sequence_id() -> None:
    world = list(range(8))
    rings = {r: ring(group("0", world, 10, waiting=True)) for r in world if r != 5}
    rings[5] = ring(group("0", world, 9, waiting=False))
    v = analyze(rings, world=8, nodes={5: "n17"})
    assert v["kind"] == "culprit"
    assert v["culprits"] == [5]
    assert v["victims"] == [0, 1, 2, 3, 4, 6, 7]
    assert (v["seq"], v["op"], v["group"]) == (
        10,
        "all_reduce",
        {"pg": "0", "desc": "default_pg", "size": 8},
    )
    assert v["summary"].startswith(
        "rank 5 (node n17) never entered all_reduce #10 on pg 0 (default_pg, 8 ranks); "
        "7 ranks wait in it since "
    )
    rows = table(rings, v, world=8, nodes={5: "n17"})[0]["rows"]
    assert rows[0]["rank"] == 5 and rows[0]["role"] == "culprit" and rows[0]["last_seq"] == 9
    assert {r["role"] for r in rows[1:]} == {"victim"}


def test_a_desync_names_both_sides() -> None:
    rings = {
        0: ring(group("0", [0, 1], 2, waiting=True)),
        1: ring(
            {
                **group("0", [0, 1], 3, waiting=True),
                "entries": [entry(1, done=True), entry(2, done=True, size=0), entry(3, done=False)],
            }
        ),
    }
    v = analyze(rings, world=2)
    assert v["kind"] == "desync"
    assert v["culprits"] == [0, 1]
    assert v["desync"]["seq"] == 2
    assert sorted(s["sizes"] for s in v["desync"]["sides"]) == [[[0]], [[1024]]]
    assert "rank 0 issued all_reduce Float[[1024]]" in v["summary"]
    assert "rank 1 issued all_reduce Float[[0]]" in v["summary"]


def test_the_right_group_of_two_is_named() -> None:
    # pg 1 holds ranks 4..7; each step: pg 1's collective, then pg 0's. Rank 5 hangs
    # before its pg 1 collective: 4, 6, 7 wait in pg 1; 0..3 wait in pg 0 on 4..7.
    world = list(range(8))
    rings = {}
    for r in world:
        groups = []
        if r < 4:
            groups.append(group("0", world, 10, waiting=True))
        else:
            groups.append(group("0", world, 9, waiting=False))
            groups.append(
                group("1", [4, 5, 6, 7], 9 if r == 5 else 10, waiting=r != 5, desc="undefined")
            )
        rings[r] = ring(*groups)
    v = analyze(rings, world=8)
    assert v["culprits"] == [5]
    assert v["group"]["pg"] == "1" and v["seq"] == 10
    assert v["victims"] == [0, 1, 2, 3, 4, 6, 7]
    assert "3 ranks wait in it" in v["summary"] and "4 more blocked behind them" in v["summary"]


def test_a_dead_rank_is_the_culprit_from_the_survivors_rings() -> None:
    rings = {r: ring(group("0", [0, 1, 2, 3], 7, waiting=True)) for r in (0, 1, 3)}
    v = analyze(rings, world=4, dead=[2], nodes={2: "n2"})
    assert v["culprits"] == [2]
    assert v["summary"].startswith("rank 2 (node n2) is dead (no heartbeats) and never entered")


def test_rings_that_cannot_be_used_are_left_out_and_said() -> None:
    world = [0, 1, 2]
    rings = {r: ring(group("0", world, 5, waiting=True)) for r in (0, 1)}
    rings[2] = ring(group("0", world, 4, waiting=False))
    rings[9] = ring(group("0", world, 4, waiting=False))
    bad = group("0", world, 5, waiting=True)
    bad["entries"] = list(reversed(bad["entries"]))
    rings[1] = ring(bad)
    v = analyze(rings, world=3)
    assert v["unusable"] == {
        "1": "its sequence ids go backwards on pg 0 (4 after 5)",
        "9": "rank 9 is outside the run's world (3 ranks)",
    }
    assert v["culprits"] == [2] and v["victims"] == [0]


def test_a_ring_going_back_from_the_same_ranks_earlier_ring_is_left_out() -> None:
    world = [0, 1, 2]
    rings = {r: ring(group("0", world, 5, waiting=True)) for r in (0, 1)}
    rings[2] = ring(group("0", world, 4, waiting=False))
    earlier = {
        0: ring(group("0", world, 5, waiting=True)),  # the same: fine
        1: ring(group("0", world, 9, waiting=False)),  # #9 before, #5 now: backwards
        2: {"available": False, "reason": "no torch", "groups": []},  # nothing to go back from
    }
    v = analyze(rings, world=3, earlier=earlier)
    assert v["unusable"] == {
        "1": "its sequence ids go backwards on pg 0: its newest ring ends at #5, the one it "
        "sent before at #9"
    }
    assert v["culprits"] == [2] and v["victims"] == [0]
    assert analyze(rings, world=3)["unusable"] == {}


def test_no_usable_ring_says_why() -> None:
    v = analyze({0: {"available": False, "reason": "torch is not loaded", "groups": []}}, world=2)
    assert v["kind"] == "no_data"
    assert "rank 0: torch is not loaded" in v["summary"]


def test_everyone_in_the_same_collective_is_not_a_culprit() -> None:
    rings = {r: ring(group("0", [0, 1], 4, waiting=True)) for r in (0, 1)}
    v = analyze(rings, world=2)
    assert v["kind"] == "none" and v["culprits"] == []
    assert "no rank is missing" in v["summary"]


def test_a_member_whose_ring_is_not_in_is_not_said_to_have_entered() -> None:
    # Ranks 0, 1 and 3 wait in #11; rank 2's ring has not come (asked, not answered):
    # "no rank is missing" would be a guess against it.
    world = [0, 1, 2, 3]
    rings = {r: ring(group("0", world, 11, waiting=True)) for r in (0, 1, 3)}
    v = analyze(rings, world=4, nodes={2: "n2"})
    assert v["kind"] == "incomplete" and v["culprits"] == []
    assert v["unread"] == [2] and v["victims"] == [0, 1, 3] and v["seq"] == 11
    assert "no rank is missing" not in v["summary"]
    assert v["summary"] == (
        "ranks 0, 1, 3 wait in all_reduce #11 on pg 0 (default_pg, 4 ranks) and every rank "
        "whose ring was read entered it; not read: rank 2 (node n2): no ring in yet. The "
        "rank missing, if any, is among those not read"
    )
    # Its ring in, it is named.
    rings[2] = ring(group("0", world, 10, waiting=False))
    assert analyze(rings, world=4)["culprits"] == [2]


def test_a_member_whose_ring_is_left_out_is_not_said_to_have_entered() -> None:
    world = [0, 1, 2]
    rings = {r: ring(group("0", world, 5, waiting=True)) for r in (0, 1)}
    bad = group("0", world, 4, waiting=False)
    bad["entries"] = list(reversed(bad["entries"]))
    rings[2] = ring(bad)
    v = analyze(rings, world=3)
    assert v["kind"] == "incomplete" and v["unread"] == [2]
    assert (
        "rank 2: ring left out (its sequence ids go backwards on pg 0 (3 after 4))"
        in (v["summary"])
    )
