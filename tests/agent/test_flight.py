"""The Flight Recorder reader: turning it on, reading a dump, when to read it; and the
real recorder on two gloo ranks, hung in a collective and desynced by the drill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from trainwarden.agent.drills import DIE_EXIT_CODE
from trainwarden.agent.flight import ENV, Flight, enable, parse

from ..net import free_port

# -- enable --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # enable() writes os.environ itself: setenv first, so the test's value is undone.
    monkeypatch.setenv(ENV, "")
    monkeypatch.delenv(ENV)


def test_enable_asks_for_the_ring_when_the_user_did_not() -> None:
    assert enable(2000) is None or dist.is_initialized()
    assert os.environ[ENV] == "2000"


def test_enable_never_overrides_the_users_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "500")
    assert enable(2000) is None
    assert os.environ[ENV] == "500"
    monkeypatch.setenv(ENV, "0")  # the user turned it off
    enable(2000)
    assert os.environ[ENV] == "0"


def test_enable_zero_turns_the_recorder_off() -> None:
    # torch 2.13 records gloo collectives with the variable unset: only 0 turns it off.
    assert enable(0) is None
    assert os.environ[ENV] == "0"


ONE_RANK = """
import json, os, sys, tempfile
import torch
import torch.distributed as dist
import trainwarden.agent as tw
from trainwarden.agent import flight

setup = sys.argv[1]
if setup.startswith("init:"):
    tw.init(run="fr-init", flight_recorder_entries=int(setup[5:]), gpu_interval_s=0)
with tempfile.TemporaryDirectory() as tmp:
    store = dist.FileStore(os.path.join(tmp, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    late = flight.enable(2000) if setup == "late" else None
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    raw = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))
    dump = flight.dump(trigger="command")
    dist.destroy_process_group()
print(json.dumps({"env": os.environ.get(flight.ENV), "recorded": len(raw.get("entries") or []),
                  "dump": dump, "late": late}))
"""


def one_rank(setup: str) -> dict[str, Any]:
    """A 1-rank gloo group in a process of its own (this one may have a group, or torch's
    recorder already read its variable): ``setup`` is ``none`` (no trainwarden),
    ``init:N`` (``tw.init`` with ``flight_recorder_entries=N`` first, no collector) or
    ``late`` (``enable`` after the group exists)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != ENV and not k.startswith("TRAINWARDEN_") and k not in ("RANK", "WORLD_SIZE")
    }
    done = subprocess.run(
        [sys.executable, "-c", ONE_RANK, setup],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_trainwarden_torch_records_gloo_collectives() -> None:
    # Why 0 has to be written: with the variable unset, the ring is on.
    out = one_rank("none")
    assert (out["env"], out["recorded"]) == (None, 3)


def test_tw_init_turns_the_recorder_on_with_2000_entries() -> None:
    out = one_rank("init:2000")
    assert (out["env"], out["recorded"]) == ("2000", 3)
    (group,) = out["dump"]["groups"]
    assert [e["seq"] for e in group["entries"]] == [1, 2, 3]


def test_tw_init_with_zero_entries_leaves_the_ring_empty() -> None:
    out = one_rank("init:0")
    assert (out["env"], out["recorded"]) == ("0", 0)
    assert out["dump"]["available"] is False
    assert "off in this process (TORCH_FR_BUFFER_SIZE=0)" in out["dump"]["reason"]


def test_enable_after_the_process_group_says_it_may_come_too_late() -> None:
    out = one_rank("late")
    assert out["late"] is not None
    assert "before torch.distributed.init_process_group" in out["late"]
    assert out["env"] == "2000"


# -- parse ---------------------------------------------------------------------------------


def entry(pg: str, desc: str, seq: int, **fields: Any) -> dict[str, Any]:
    """One entry as torch 2.13's ``_dump_fr_trace_json`` writes it (gloo)."""
    return {
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "is_p2p": False,
        "pg_id": int(pg),
        "process_group": [pg, desc],
        "profiling_name": "gloo:all_reduce",
        "input_sizes": [[10]],
        "input_dtypes": ["Float"],
        "output_sizes": [[10]],
        "output_dtypes": ["Float"],
        "state": "scheduled",
        "retired": True,
        "time_created_ns": 1_700_000_000_000_000_000 + seq,
        "time_discovered_started_ns": 0,
        "time_discovered_completed_ns": 0,
        **fields,
    }


RAW = {
    "version": "2.10",
    "pg_status": {
        "0": {"last_enqueued_collective": "7", "last_completed_collective": "6"},
        "1": {"last_enqueued_collective": "2", "last_completed_collective": "-1"},
    },
    "entries": [
        *(entry("0", "default_pg", seq) for seq in (3, 1, 2, 4, 5, 6)),  # not in order
        entry("0", "default_pg", 7, retired=False, input_sizes=[[0]], output_sizes=[[0]]),
        entry(
            "1", "undefined", 1, profiling_name="nccl:broadcast", state="completed", retired=False
        ),
        entry("1", "undefined", 2, state="started", retired=False, time_discovered_started_ns=5e9),
        entry("0", "default_pg", 0, is_p2p=True, profiling_name="gloo:send", p2p_seq_id=1),
    ],
}


def test_parse_keeps_the_newest_entries_of_each_group() -> None:
    data = parse(RAW, ranks={"0": [0, 1, 2, 3], "1": [2, 3]}, keep=3)
    assert data["available"] is True and data["reason"] is None
    default, upper = data["groups"]
    assert (default["pg"], default["desc"], default["ranks"]) == ("0", "default_pg", [0, 1, 2, 3])
    assert [e["seq"] for e in default["entries"]] == [5, 6, 7]  # oldest first; the p2p left out
    assert default["dropped"] == 4
    assert [e["done"] for e in default["entries"]] == [True, True, False]  # gloo: retired
    newest = default["entries"][-1]
    assert (newest["op"], newest["in_sizes"], newest["in_dtypes"]) == (
        "all_reduce",
        [[0]],
        ["Float"],
    )
    assert newest["created"] == pytest.approx(1.7e9) and newest["started"] is None
    assert (default["last_enqueued"], default["last_completed"]) == (7, 6)

    assert (upper["pg"], upper["ranks"], upper["dropped"]) == ("1", [2, 3], 0)
    assert [(e["op"], e["state"], e["done"]) for e in upper["entries"]] == [
        ("broadcast", "completed", True),  # NCCL: its state says completed
        ("all_reduce", "started", False),
    ]
    assert upper["entries"][1]["started"] == pytest.approx(5.0)
    assert (upper["last_enqueued"], upper["last_completed"]) == (2, None)


def test_parse_without_ranks_or_entries() -> None:
    assert parse({"entries": []}, ranks={}, keep=32)["groups"] == []
    (group,) = parse({"entries": [entry("0", "default_pg", 1)]}, ranks={}, keep=0)["groups"]
    assert (group["ranks"], group["entries"], group["dropped"]) == ([], [], 1)
    assert (group["last_enqueued"], group["last_completed"]) == (None, None)


# -- Flight: when to read -------------------------------------------------------------------


class Host:
    """What Flight sends to: the agent's events, its flush."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int | None, str, dict[str, Any]]] = []
        self.flushes = 0
        self.last_step: int | None = None

    def event(
        self, kind: str, *, step: int | None = None, severity: str = "info", **data: Any
    ) -> None:
        self.events.append((kind, step, severity, data))

    def flush_soon(self) -> None:
        self.flushes += 1


class Reader:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(kwargs)
        return {**kwargs, "available": True, "reason": None, "groups": []}


def flight_at(progress: list[tuple[int | None, float | None]], entries: int = 2000):
    host, reader = Host(), Reader()
    f = Flight(host, entries=entries, progress=lambda: progress[-1], reader=reader)
    return f, host, reader


def test_no_dump_before_the_first_step() -> None:
    f, host, reader = flight_at([(None, None)])
    f.tick(now=1e9)
    assert reader.calls == [] and host.events == []


def test_a_stall_in_the_first_seconds_is_left_to_the_collector() -> None:
    # One step time learnt, then a first profiled step takes 20 s (CUPTI starting on a GPU).
    progress: list[tuple[int | None, float | None]] = [(0, 100.0)]
    f, host, reader = flight_at(progress)
    f.tick(now=100.5)
    progress.append((30, 101.0))
    f.tick(now=101.5)
    f.tick(now=121.0)
    assert f.step_time_s() is not None and reader.calls == [] and host.events == []


def test_one_dump_per_stall_not_per_tick() -> None:
    progress: list[tuple[int | None, float | None]] = [(1, 996.0)]
    f, host, reader = flight_at(progress)
    for step, ended in ((2, 997.0), (3, 998.0), (4, 999.0), (5, 1000.0)):  # 1 s a step
        f.tick(now=ended - 0.5)
        progress.append((step, ended))
    f.tick(now=1001.0)
    f.tick(now=1004.9)
    assert reader.calls == []  # under HUNG_MIN_S
    f.tick(now=1006.0)
    f.tick(now=1007.0)
    f.tick(now=1030.0)
    assert reader.calls == [{"trigger": "stalled"}]
    kind, _, severity, data = host.events[0]
    assert (kind, severity, data["stalled_s"]) == ("collectives", "warning", 6.0)
    assert host.flushes == 1
    # Steps go on (1 s each; the stall counts once among the learnt step times) ...
    for step, ended in ((6, 1040.0), (10, 1044.0), (14, 1048.0), (18, 1052.0)):
        progress.append((step, ended))
        f.tick(now=ended + 0.5)
    assert len(reader.calls) == 1 and f.step_time_s() == pytest.approx(1.0)
    f.tick(now=1052.0 + 5.5)  # ... and stop again: another stall, another dump
    assert len(reader.calls) == 2 and f.dumps == 2


def test_the_threshold_is_learnt_from_the_step_times() -> None:
    progress: list[tuple[int | None, float | None]] = [(0, 100.0)]
    f, _, reader = flight_at(progress)
    for step in (2, 4, 6, 8):  # 2 s a step, seen at ticks two steps apart
        progress.append((step, 100.0 + 2 * step))
        f.tick(now=100.0 + 2 * step + 0.1)
    assert f.step_time_s() == pytest.approx(2.0)
    f.tick(now=116.0 + 9.5)  # past HUNG_MIN_S, under 5 x 2 s
    assert reader.calls == []
    f.tick(now=116.0 + 10.5)
    assert reader.calls == [{"trigger": "stalled"}]


def test_entries_zero_never_dumps_on_a_stall() -> None:
    f, host, reader = flight_at([(3, 0.0)], entries=0)
    f.tick(now=0.0)
    f.tick(now=1e6)
    assert reader.calls == [] and host.events == [] and f.dumps == 0


def test_a_command_is_answered_with_the_dump() -> None:
    f, host, reader = flight_at([(None, None)])
    host.last_step = 41
    f.answer({"id": 7, "type": "collectives"})
    assert reader.calls == [{"trigger": "command", "request": 7}]
    assert [(k, s, sev) for k, s, sev, _ in host.events] == [("collectives", 41, "warning")]


def test_entries_zero_answers_a_command_unavailable_with_the_reason() -> None:
    f, host, reader = flight_at([(None, None)], entries=0)
    f.answer({"id": 9, "type": "collectives"})
    assert reader.calls == []
    ((kind, _, severity, data),) = host.events
    assert (kind, severity) == ("collectives", "info")
    assert (data["available"], data["trigger"], data["request"], data["groups"]) == (
        False,
        "command",
        9,
        [],
    )
    assert "flight_recorder_entries=0" in data["reason"]
    assert host.flushes == 1


# -- the real recorder on two gloo ranks ----------------------------------------------------

PRELUDE = """
import json, os, sys, threading, time
from datetime import timedelta
import torch
import torch.distributed as dist
from trainwarden.agent import flight

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)

def newest(dump):
    groups = [g for g in dump["groups"] if g["pg"] == "0"]
    return groups[0]["entries"][-1] if groups and groups[0]["entries"] else None

def dump_when(blocked, name):
    # From another thread while the training thread waits: poll until it is blocked.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        dump = flight.dump(trigger="stalled")
        if blocked(newest(dump)):
            break
        time.sleep(0.02)
    with open(f"{out}/{name}.tmp", "w") as f:
        json.dump(dump, f)
    os.rename(f"{out}/{name}.tmp", f"{out}/{name}.json")
"""

HUNG = (
    PRELUDE
    + """
flight.enable(2000)
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
    timeout=timedelta(seconds=30),
)
t = torch.ones(10)
for i in range(3):
    if i == 2 and rank == 0:
        blocked = lambda e: e is not None and e["seq"] == 3 and not e["done"]
        threading.Thread(target=dump_when, args=(blocked, "hung"), daemon=True).start()
    if i == 2 and rank == 1:  # late to the 3rd all_reduce: until rank 0 has read its ring
        deadline = time.monotonic() + 20
        while not os.path.exists(f"{out}/hung.json") and time.monotonic() < deadline:
            time.sleep(0.02)
    dist.all_reduce(t)
if rank == 0:  # gloo records the retirement just after the wait returns: poll
    dump_when(lambda e: e is not None and e["done"], "after")
dist.destroy_process_group()
"""
)


def start_ranks(code: str, out: str) -> list[subprocess.Popen[str]]:
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "TRAINWARDEN_URL", "RANK")}
    return [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), port, out],
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]


def finish(procs: list[subprocess.Popen[str]], timeout: float = 30) -> list[tuple[int, str]]:
    results = []
    for p in procs:
        try:
            output, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            output, _ = p.communicate()
        results.append((p.returncode, output))
    return results


def groups(path: Path) -> dict[str, dict[str, Any]]:
    dump = json.loads(path.read_text())
    assert dump["available"] is True, dump["reason"]
    return {g["pg"]: g for g in dump["groups"]}


def test_a_rank_blocked_in_a_collective_shows_it_not_done(tmp_path: Path) -> None:
    results = finish(start_ranks(HUNG, str(tmp_path)))
    assert [code for code, _ in results] == [0, 0], results
    hung = json.loads((tmp_path / "hung.json").read_text())
    assert (hung["trigger"], hung["available"]) == ("stalled", True)
    group = groups(tmp_path / "hung.json")["0"]
    assert group["ranks"] == [0, 1]
    assert [(e["seq"], e["op"], e["in_sizes"], e["done"]) for e in group["entries"]] == [
        (1, "all_reduce", [[10]], True),
        (2, "all_reduce", [[10]], True),
        (3, "all_reduce", [[10]], False),  # rank 1 had not arrived
    ]
    # torch's own counters: last_completed is advanced by its watchdog thread and can lag
    # the entries' done flags (a loaded CI: 1 with seq 2 done); the collector reads the
    # flags (collector/health/collectives.py), the counter only as a lower bound.
    assert group["last_enqueued"] == 3 and group["last_completed"] in (1, 2), group
    after = groups(tmp_path / "after.json")["0"]
    assert [e["done"] for e in after["entries"]] == [True, True, True]


DESYNC = (
    PRELUDE
    + """
import trainwarden.agent as tw

class Events:  # what the agent sends: its events, one JSON line each
    def send(self, path, body):
        with open(f"{out}/events-{rank}.jsonl", "a") as f:
            for e in body["events"]:
                f.write(json.dumps(e) + "\\n")
        return {}
    def close(self):
        pass

tw.init(
    run="fr-desync", rank=rank, world_size=2, drill="desync@rank=1,step=1,for=3s",
    transport=Events(), spool_dir="none", flush_interval_s=0.1,
)
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
    timeout=timedelta(seconds=30),
)
# Rank 0 waits in seq 2 (step 1's all_reduce); rank 1 in seq 3 (its empty one was seq 2).
blocked = lambda e: e is not None and e["seq"] == 2 + rank and not e["done"]
threading.Thread(target=dump_when, args=(blocked, f"rank{rank}"), daemon=True).start()
t = torch.ones(10)
try:
    for i in range(5):
        if i == 1:
            print("step1", time.time(), flush=True)
        with tw.step(i):
            dist.all_reduce(t)
except RuntimeError as exc:
    print("collective failed:", type(exc).__name__, exc, flush=True)
    os._exit(3)
print("finished", flush=True)
"""
)


def test_the_desync_drill_shows_two_sizes_at_one_sequence_id(tmp_path: Path) -> None:
    procs = start_ranks(DESYNC, str(tmp_path))
    try:
        procs[1].wait(timeout=30)
        exited = time.time()
    finally:
        results = finish(procs)
    (code0, out0), (code1, out1) = results
    assert code1 == DIE_EXIT_CODE, out1
    step1 = float(next(line for line in out1.splitlines() if line.startswith("step1")).split()[1])
    assert 3.0 <= exited - step1 < 12, (exited - step1, out1)  # for=3s, then the exit
    # Rank 0 waited in seq 2 for a rank that never came; it failed when that rank exited.
    assert code0 == 3 and "collective failed" in out0, out0
    assert "finished" not in out0

    rank0, rank1 = groups(tmp_path / "rank0.json")["0"], groups(tmp_path / "rank1.json")["0"]
    seq0 = {e["seq"]: e for e in rank0["entries"]}
    seq1 = {e["seq"]: e for e in rank1["entries"]}
    assert (seq0[1]["in_sizes"], seq1[1]["in_sizes"]) == ([[10]], [[10]])  # step 0: in step
    assert (seq0[2]["in_sizes"], seq1[2]["in_sizes"]) == ([[10]], [[0]])  # the desync
    assert seq0[2]["done"] is False and max(seq0) == 2
    assert seq1[3]["in_sizes"] == [[10]] and seq1[3]["done"] is False and max(seq1) == 3

    events = [json.loads(line) for line in (tmp_path / "events-1.jsonl").read_text().splitlines()]
    drills = [e["data"] for e in events if e["kind"] == "drill"]
    assert [(d["fault"], d.get("timed_out"), d.get("skipped")) for d in drills] == [
        ("desync", None, None),
        ("desync", True, None),
    ]


# -- a torch whose recorder is missing or fails ----------------------------------------------


class Collector:
    """The agent's transport seam: answers the first batch with a ``collectives``
    command (as the collector does when a rank is hung) and keeps what it was sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        first = not self.bodies
        self.bodies.append(body)
        return {"commands": [{"id": 1, "type": "collectives"}]} if first else {}

    def close(self) -> None:
        pass

    def events(self) -> list[dict[str, Any]]:
        return [e for b in self.bodies for e in b["events"]]


def run_agent(monkeypatch: pytest.MonkeyPatch) -> Collector:
    """A real agent, asked for its collectives while its trainer steps; what it sent."""
    import trainwarden.agent as tw

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRAINWARDEN_URL", "TRAINWARDEN_RUN"):
        monkeypatch.delenv(name, raising=False)
    collector = Collector()
    tw.init(run="fr-broken", transport=collector, flush_interval_s=0.02, gpu_interval_s=0)
    try:
        step = 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
            e["kind"] == "collectives" for e in collector.events()
        ):
            with tw.step(step):
                time.sleep(0.005)
            step += 1
        for extra in range(step, step + 5):
            with tw.step(extra):
                pass
    finally:
        tw.shutdown(timeout_s=5)
    return collector


def kinds(events: list[dict[str, Any]]) -> set[str]:
    return {e["kind"] for e in events}


@pytest.mark.parametrize("broken", ["missing", "raises"])
def test_a_missing_or_failing_reader_gives_one_event_saying_why(
    monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    import torch

    c10d = torch._C._distributed_c10d
    working = run_agent(monkeypatch)  # the same agent, torch's recorder as it is
    # Stand-ins for a torch this environment does not have: one without the recorder
    # (before 2.5), one whose dump fails.
    if broken == "missing":
        for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
            monkeypatch.delattr(c10d, name, raising=False)
    else:

        def fails(*args: Any) -> str:
            raise RuntimeError("the ring is corrupt")

        monkeypatch.setattr(c10d, "_dump_fr_trace_json", fails)
    collector = run_agent(monkeypatch)

    (answer,) = [e for e in collector.events() if e["kind"] == "collectives"]
    data = answer["data"]
    assert (data["available"], data["trigger"], data["request"], data["groups"]) == (
        False,
        "command",
        1,
        [],
    )
    if broken == "missing":
        assert "has no Flight Recorder" in data["reason"], data["reason"]
    else:
        assert "dump failed: RuntimeError: the ring is corrupt" in data["reason"], data["reason"]
    # Nothing else changes: the same kinds of events, every step sent, in order.
    assert kinds(collector.events()) == kinds(working.events())
    steps = [s["step"] for b in collector.bodies for s in b["steps"]]
    assert steps == list(range(len(steps))) and len(steps) >= 6
