"""The agent across the process's life: a fork (DataLoader workers) and SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import trainwarden.agent as tw

from ..net import closed_port
from .helpers import RecordingTransport

pytestmark = pytest.mark.usefixtures("clean_agent")


def test_a_forked_child_never_reports_and_its_exit_is_not_the_ranks_shutdown() -> None:
    transport = RecordingTransport()
    tw.init(run="unit", transport=transport, flush_interval_s=0.02)
    with tw.step(0):
        pass
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a DataLoader worker, say
        code = 1
        try:
            core = tw.init.__globals__["_core"]
            agent = core._agent
            with tw.step(1):  # harmless: kept in memory, never sent
                pass
            core._flush_at_exit()  # what atexit runs when the child exits: must do nothing
            state = {"exporter": agent._exporter is None, "closed": agent._closed}
            os.write(write, json.dumps(state).encode())
            code = 0
        finally:
            os._exit(code)  # never back into pytest in the child
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child = json.loads(os.read(read, 1000))
    os.close(read)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert child == {"exporter": True, "closed": True}
    with tw.step(2):
        pass
    tw.shutdown(timeout_s=2)
    assert [s["step"] for s in transport.steps()] == [0, 2]  # the child's step 1 never came
    assert [e["kind"] for e in transport.events()].count("shutdown") == 1


def test_a_forked_child_s_sigterm_is_not_taken_for_the_rank_s() -> None:
    """DataLoader workers are ended with SIGTERM. A child inherits the signals' wake-up
    fd, which the agent's thread reads as the rank's own SIGTERM: the child drops it."""
    transport = RecordingTransport()
    agent = tw.init(run="unit", transport=transport, flush_interval_s=0.02)
    with tw.step(0):
        pass
    pid = os.fork()
    if pid == 0:  # the child, with the agent's SIGTERM handler: it must die of the signal
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        finally:
            os._exit(3)
    started = time.monotonic()
    _, status = os.waitpid(pid, 0)
    took = time.monotonic() - started
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, (status, took)
    # at once: the child has nothing to flush (a child that waited for a flush would take
    # the agent's shutdown deadline, 5 s, and more)
    assert took < 5, (took, os.getloadavg())
    time.sleep(1.5)  # past the stuck-thread grace: long enough to have flushed, wrongly
    said = [e for e in transport.events() if e["kind"] in ("signal", "attempt_end", "shutdown")]
    assert not agent._closed, (agent.signalled_at, said)
    assert [e for e in said if e["kind"] == "signal"] == [], said


def test_sigterm_flushes_to_the_spool_and_the_process_still_dies_of_it(tmp_path: Path) -> None:
    trainer = textwrap.dedent(f"""
        import sys, time
        import trainwarden.agent as tw
        tw.init(run="term", url="http://127.0.0.1:{closed_port()}", flush_interval_s=0.05,
                request_timeout_s=0.5, profile_every=0, spool_dir={str(tmp_path)!r})
        step = 0
        while True:
            with tw.step(step):
                time.sleep(0.002)
            if step == 20:
                print("ready", flush=True)
            step += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", trainer], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM  # it died of the signal, as it would have
    finally:
        proc.kill()
    batches = [
        json.loads(p.read_text()) for p in sorted((tmp_path / "term" / "rank-0").glob("*.json"))
    ]
    steps = [s["step"] for b in batches for s in b["steps"]]
    events = {e["kind"]: e for b in batches for e in b["events"]}
    assert steps == list(range(len(steps))) and len(steps) > 20  # every step, in order, once
    assert events["signal"]["data"] == {"signal": "SIGTERM"}
    assert events["shutdown"]["step"] == steps[-1]
    # when the signal came, for the collector (a stall after it is the teardown's)
    assert events["signal"]["ts"] - 1 < events["shutdown"]["data"]["signalled_at"]
    assert events["shutdown"]["data"]["signalled_at"] <= events["signal"]["ts"]


def test_a_trainers_own_sigterm_handler_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    mine: list[Any] = []
    previous = signal.signal(signal.SIGTERM, lambda *a: mine.append(a))
    try:
        tw.init(run="unit", transport=RecordingTransport())
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM).__name__ == "<lambda>"  # type: ignore[union-attr]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_during_the_flush_at_exit_lets_it_finish_then_kills(tmp_path: Path) -> None:
    """The trainer dies of an exception; while its flush at exit is on the wire, the
    launcher (which stops the other ranks when one fails) sends SIGTERM: the goodbye still
    goes out, and the process then dies of the signal (as torchrun's rank 0 did when rank 1
    died: its goodbye, held by its own node relay for the relay's window, was lost)."""
    out = tmp_path / "sent.json"
    trainer = textwrap.dedent(f"""
        import json, os, signal, time
        import trainwarden.agent as tw

        class Slow:
            def send(self, path, body):
                kinds = [e["kind"] for e in body.get("events", [])]
                if "shutdown" in kinds:
                    os.kill(os.getpid(), signal.SIGTERM)  # the launcher, mid-request
                    time.sleep(0.5)
                    with open({str(out)!r}, "w") as f:
                        json.dump(kinds, f)
                return {{}}

            def close(self):
                pass

        tw.init(run="term", transport=Slow(), flush_interval_s=0.05, profile_every=0)
        for step in range(5):
            with tw.step(step):
                time.sleep(0.002)
        raise RuntimeError("a collective's peer went away")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", trainer], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
    assert "shutdown" in json.loads(out.read_text()), proc.stderr[-2000:]


def test_sigterm_while_stuck_in_a_collective_still_says_goodbye(tmp_path: Path) -> None:
    """A Python signal handler waits for the main thread to leave its C call: a rank blocked
    in a collective whose peer never comes (a hang, a desync) would say nothing until the
    launcher's SIGKILL. The agent's own thread reads the signal's wake-up byte and flushes
    for it (core.py): the goodbye, with the SIGTERM as its end, is out within seconds while
    the process is still stuck."""
    port = closed_port()
    rendezvous = closed_port()  # free now: the rendezvous binds it
    rank_script = textwrap.dedent(f"""
        import os, sys, time
        import torch, torch.distributed as dist
        import trainwarden.agent as tw
        rank = int(sys.argv[1])
        tw.init(run="stuck", url="http://127.0.0.1:{port}", flush_interval_s=0.05,
                request_timeout_s=0.5, profile_every=0, rank=rank, world_size=2,
                spool_dir={str(tmp_path)!r})
        dist.init_process_group("gloo", rank=rank, world_size=2,
                                init_method="tcp://127.0.0.1:{rendezvous}")
        if rank == 1:
            time.sleep(600)  # never enters the collective: rank 0 waits in it
        for step in range(10):
            with tw.step(step):
                if step == 5:
                    print("blocking", flush=True)
                    dist.all_reduce(torch.ones(4))  # waits for rank 1, in C++
    """)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", rank_script, str(rank)], stdout=subprocess.PIPE, text=True
        )
        for rank in (0, 1)
    ]
    try:
        assert procs[0].stdout is not None and procs[0].stdout.readline().strip() == "blocking"
        time.sleep(0.5)
        procs[0].send_signal(signal.SIGTERM)
        spool = tmp_path / "stuck" / "rank-0"
        deadline = time.monotonic() + 15
        events: dict[str, Any] = {}
        while "attempt_end" not in events and time.monotonic() < deadline:
            time.sleep(0.2)
            for path in sorted(spool.glob("*.json")):
                with contextlib.suppress(ValueError):  # being written
                    events.update({e["kind"]: e for e in json.loads(path.read_text())["events"]})
        assert procs[0].poll() is None  # still stuck in the collective: the flush was not its
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)
    assert events["attempt_end"]["data"]["reason"] == "sigterm", events.get("attempt_end")
    assert events["signal"]["data"] == {"signal": "SIGTERM", "stuck_in": "step"}
    assert events["shutdown"]["step"] == 4  # the last step it finished
    # the signal's arrival, not the flush's start a grace later
    assert events["shutdown"]["data"]["signalled_at"] < events["signal"]["ts"] - 0.5
