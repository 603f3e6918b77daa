"""A rank's last words (agent/last_words.py) with real processes: a child rank that dies
of SIGABRT or SIGSEGV leaves them; this process, another rank of the run on the node,
reports them on its behalf, once; a shared stderr is not read; a live process, or one
whose pid was reused, is judged by its pid's start time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import trainwarden.agent as tw
from trainwarden.agent import last_words

from .helpers import RecordingTransport

RUN = "lw"
CHILD = """
import ctypes, os, sys, time
import trainwarden.agent as tw

def crash(mode):
    if mode == "abort":  # what libstdc++ writes before abort() on an uncaught exception
        os.write(2, b"terminate called after throwing an instance of 'c10::Error'\\n"
                    b"  what():  boom from C++\\n")
        os.abort()
    if mode == "segv":
        ctypes.string_at(0)
    sys.stdin.read()  # "live": until the test closes stdin

tw.init(run="lw", rank=1, world_size=4, url="http://127.0.0.1:9", flush_interval_s=0.05)
for step in range(3):
    with tw.step(step):
        pass
time.sleep(0.3)  # the exporter thread ticks: the progress marker says step 2
with tw.step(3):
    crash(sys.argv[1])
"""


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRAINWARDEN_URL", "TRAINWARDEN_RUN"):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)


def child(mode: str, stderr: Path, **kw: Any) -> subprocess.Popen[bytes]:
    with stderr.open("ab") as err:
        return subprocess.Popen(
            [sys.executable, "-c", CHILD, mode], stderr=err, stdin=subprocess.PIPE, **kw
        )


def crashed(mode: str, stderr: Path) -> int:
    proc = child(mode, stderr)
    proc.communicate(timeout=60)
    return proc.returncode


def reports() -> list[dict[str, Any]]:
    """What this process (rank 0 of the run) sends of its siblings, from start to shutdown."""
    transport = RecordingTransport()
    tw.init(run=RUN, rank=0, world_size=4, transport=transport, flush_interval_s=0.05)
    tw.shutdown(timeout_s=3)
    return [e for e in transport.events() if e["kind"] == "rank_crashed"]


def files(kind: str) -> list[Path]:
    root = Path(os.environ["TRAINWARDEN_SPOOL_DIR"]) / RUN / last_words.DIRNAME / "rank-1"
    return sorted(root.glob(f"*.{kind}"))


def test_a_rank_aborted_by_cxx_leaves_its_signal_step_stack_and_message(tmp_path: Path) -> None:
    assert crashed("abort", tmp_path / "rank1.err") == -signal.SIGABRT
    (event,) = reports()
    data = event["data"]
    assert (event["rank"], event["severity"], event["step"]) == (1, "critical", 2)
    assert event["id"] == f"rank_crashed:{data['session']}"
    assert data["signal"] == "SIGABRT" and data["last_step"] == 2
    assert data["cause"] == "C++ exception c10::Error: boom from C++"
    assert data["stderr"] == str(tmp_path / "rank1.err")
    assert data["stack_thread"] == "main" and data["where"] == "<string>:9 in crash"  # os.abort()
    assert [f["function"] for f in data["stack"]][:2] == ["crash", "<module>"]
    assert data["reported_by"]["rank"] == 0
    assert reports() == []  # once: the next agent finds it reported


def test_a_segfault_is_kept_without_a_cxx_message(tmp_path: Path) -> None:
    assert crashed("segv", tmp_path / "rank1.err") == -signal.SIGSEGV
    (event,) = reports()
    data = event["data"]
    assert data["signal"] == "SIGSEGV" and data["cause"] is None
    assert "no C++ terminate message" in data["cause_note"]
    assert any(f["function"] == "string_at" for f in data["stack"])


def test_a_message_in_a_stderr_another_process_writes_to_is_not_attributed(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "job.err"
    with shared.open("ab") as err:  # a live process holding the file as its stderr
        holder = subprocess.Popen(["sleep", "60"], stderr=err)
    try:
        assert crashed("abort", shared) == -signal.SIGABRT
        assert "boom from C++" in shared.read_text()
        (event,) = reports()
    finally:
        holder.kill()
        holder.wait()
    data = event["data"]
    assert data["signal"] == "SIGABRT" and data["cause"] is None
    assert f"its stderr {shared} is shared" in data["cause_note"]
    assert "see the rank's stderr" in data["cause_note"]
    assert "boom" not in json.dumps(data)


def test_a_live_rank_is_not_reported_and_a_reused_pid_does_not_keep_a_dead_one_alive(
    tmp_path: Path,
) -> None:
    live = child("live", tmp_path / "live.err")
    try:
        deadline = time.monotonic() + 60
        while not files("json") and time.monotonic() < deadline:
            time.sleep(0.1)
        (fault,) = files("fault")
        fault.write_text("Fatal Python error: Aborted\n")  # even with words in its file
        assert reports() == []  # alive: nothing said for it
        # Its process is gone and its pid now another's (the live child's: started later).
        assert crashed("abort", tmp_path / "rank1.err") == -signal.SIGABRT
        dead = next(p for p in files("json") if str(live.pid) not in p.read_text())
        who = json.loads(dead.read_text())
        who["pid"] = live.pid
        dead.write_text(json.dumps(who))
        (event,) = reports()
        assert event["data"]["session"] == who["session"]
    finally:
        live.communicate(timeout=60)  # stdin closed: it ends its step and exits cleanly
