"""The node relay's merging, without a network: what one columnar request holds."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from trainwarden.agent.relay import _Held, _mergeable, columnar, ranks_header


def held(rank: int, steps: list[int], **extra: Any) -> _Held:
    agent = {
        "rank": rank,
        "world_size": 16,
        "host": "n1",
        "session": f"s{rank}",
        **extra.pop("agent", {}),
    }
    body = {
        "run": "r",
        "agent": agent,
        "steps": [
            {"step": s, "ts": 1.7e9 + s, "duration_s": 0.5, **extra.pop("fields", {})}
            for s in steps
        ],
        **extra,
    }
    return _Held(b"", body, {}, time.monotonic())


def test_steps_go_column_wise_with_each_ranks_newest_header() -> None:
    a, b = held(3, [7, 8], agent={"sent_at": 1.0}), held(4, [8], fields={"loss": 2.5})
    a2 = held(3, [9], agent={"sent_at": 2.0})  # the same rank again in the window
    body = columnar([a, b, a2])
    assert body["world_size"] == 16 and body["run"] == "r"
    assert body["steps"]["rank"] == [3, 3, 4, 3]
    assert body["steps"]["step"] == [7, 8, 8, 9]
    assert body["steps"]["loss"] == [None, None, 2.5, None]  # a field some rows lack: null
    # One header a rank, the newest; mixed key sets go as objects, not columns.
    assert [(h["rank"], h.get("sent_at")) for h in body["agents"]] == [(3, 2.0), (4, None)]
    assert "extras" not in body


def test_uniform_headers_go_as_columns_and_events_as_extras() -> None:
    ev = [{"id": "e1", "kind": "note", "ts": 1.7e9}]
    body = columnar([held(0, [1]), held(1, [], events=ev), held(2, [1], gpu=[{"ts": 1.7e9}])])
    assert body["agent_columns"]["rank"] == [0, 1, 2] and "world_size" not in body["agent_columns"]
    assert [(x["agent"]["rank"], x["events"], x["gpu"]) for x in body["extras"]] == [
        (1, ev, []),
        (2, [], [{"ts": 1.7e9}]),
    ]
    assert body["steps"]["rank"] == [0, 2]


def test_what_is_not_a_batch_passes_through() -> None:
    good = held(0, [1]).body
    assert _mergeable(good)
    assert not _mergeable([good])
    assert not _mergeable({**good, "agent": {"rank": "0", "world_size": 2}})
    assert not _mergeable({**good, "steps": "x"})
    assert not _mergeable({**good, "surprise": 1})  # the collector names what is wrong


def test_sender_header_names_ranks_in_ranges() -> None:
    assert ranks_header("r", [3, 0, 1, 2, 7, 9, 10]) == "r/0-3,7,9-10"
    assert ranks_header("r", [5]) == "r/5"


def test_ranks_sharing_a_relay_share_a_flush_phase() -> None:
    from trainwarden.agent.config import AgentConfig
    from trainwarden.agent.exporter import flush_phase
    from trainwarden.agent.node_relay import group as relay_group

    def group(relay: str, node: str) -> str:
        config = AgentConfig.resolve(run="r", url="http://collector:8000", relay=relay)
        return relay_group(replace(config, node=node))

    # A relay on the node (auto, loopback): the node's ranks; one for a rack: its URL.
    assert group("auto", "n1") == "n1" and group("http://127.0.0.1:8470", "n2") == "n2"
    assert (
        group("http://rack7:8470", "n1") == group("http://rack7:8470", "n2") == "http://rack7:8470"
    )
    phases = {flush_phase(f"node{i}", 1.0) for i in range(64)}
    assert len(phases) > 50 and all(0 <= p < 1.0 for p in phases)  # nodes spread over the second
    assert flush_phase("node3", 2.0) == 2 * flush_phase("node3", 1.0)
