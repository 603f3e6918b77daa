"""A crashed culprit's last words (issue 53): three gloo ranks under torchrun, one of them
all-reduces a tensor of another size and gloo aborts it (SIGABRT, the C++ message on its
stderr only). A survivor of the node sends what it died of, under its rank: the signal,
the C++ ``what()`` line (torchrun keeps each rank's stderr in a file of its own) and the
Python frame of the trainer's all_reduce, in the collectives verdict, the timeline and the
post-mortem."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..helpers import Server, start_serve, stop_serve, wait_for
from .launch import torchrun

HERE = Path(__file__).resolve().parent
MISMATCH = "Received data size doesn't match expected size"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    server = start_serve(f"sqlite:///{tmp_path / 'tw.db'}", tmp_path / "serve.log")
    yield server
    stop_serve(server)


def crash(server: Server, tmp_path: Path, run: str, *, redirects: bool) -> str:
    """Run the job (rank 2 the culprit, at step 10); returns torchrun's output."""
    cmd = torchrun(3, *(["--redirects", "2", "--log-dir", str(tmp_path / "logs")] * redirects))
    cmd += [str(HERE / "crash_worker.py"), run, "2", "10"]
    env = {**os.environ, "TRAINWARDEN_URL": server.url, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0, done.stdout[-2000:]
    return done.stdout + done.stderr


def test_the_culprit_s_signal_cause_and_frame_reach_the_verdict_timeline_and_postmortem(
    server: Server, tmp_path: Path
) -> None:
    out = crash(server, tmp_path, "crash-own", redirects=True)
    assert "SIGABRT" in out, out[-3000:]  # torchrun saw rank 2 die of it
    view = wait_for(
        lambda: (v := server.get("/api/v1/runs/crash-own/collectives").json()).get("crashes") and v,
        30,
        "the crash in the collectives view",
    )
    assert list(view["crashes"]) == ["2"], view["crashes"]
    crash_2 = view["crashes"]["2"]
    assert crash_2["signal"] == "SIGABRT" and crash_2["collective"] == "all_reduce"
    assert MISMATCH in crash_2["cause"] and "gloo::EnforceNotMet" in crash_2["cause"]
    assert crash_2["where"].startswith("crash_worker.py:"), crash_2
    assert any(f["function"] == "all_reduce" for f in crash_2["stack"])
    verdict = view["verdict"]
    assert verdict["culprits"] == [2] and verdict["summary"].startswith("rank 2 (node ")
    assert "died of SIGABRT in all_reduce (crash_worker.py:" in verdict["summary"]
    assert MISMATCH in verdict["summary"]
    print(verdict["summary"])
    # The health evaluator's state of rank 2: dead, and what it died of.
    rank_2 = wait_for(
        lambda: (
            [r for r in server.get("/api/v1/runs/crash-own/ranks").json() if r["rank"] == 2][0][
                "state"
            ]
            == "dead"
            and server.get("/api/v1/runs/crash-own/ranks").json()[2]
        ),
        30,
        "rank 2 dead",
    )
    detail = rank_2["state_detail"]
    assert detail["role"] == "culprit" and detail["reason"].startswith("died of SIGABRT in all_")
    assert MISMATCH in detail["reason"] and "no heartbeat" in detail["silent"], detail
    # Stored once, under rank 2 (however many survivors sent it), not under the sender.
    events = server.get("/api/v1/runs/crash-own/events", kind="rank_crashed").json()
    assert [e["rank"] for e in events] == [2], events
    assert events[0]["data"]["reported_by"]["rank"] in (0, 1)
    entries = server.get("/api/v1/runs/crash-own/timeline").json()["entries"]
    (entry,) = [e for e in entries if e["kind"] == "rank_crashed"]
    assert entry["rank"] == 2 and entry["severity"] == "critical" and entry["ref"]["fault"]
    assert "died of SIGABRT in all_reduce" in entry["text"] and MISMATCH in entry["text"]
    report = server.get("/api/v1/runs/crash-own/postmortem", format="md").text
    assert "Ranks that died of a signal" in report, report
    assert "rank 2 died of SIGABRT in all_reduce" in report and MISMATCH in report
    assert "crash_worker.py:" in report and "in main" in report
    # One page for the job, naming the culprit and its cause (issue 58: a crash that tears
    # the job down), and the run's end says it failed.
    (page,) = wait_for(
        lambda: [
            a
            for a in server.get("/api/v1/alerts", run="crash-own").json()
            if a["rule"] == "JobLostInCollective" and a["state"] == "firing"
        ],
        30,
        "JobLostInCollective firing",
    )
    described = page["annotations"]["description"]
    assert described.startswith("rank 2 (node ") and "died of SIGABRT" in described, described
    assert MISMATCH in described and page["severity"] == "critical"
    # The run stays running until rank 2's silence reads as lost (its ranks did not all
    # say goodbye); its attempt already says how it ended.
    (attempt,) = server.get("/api/v1/runs/crash-own/attempts").json()
    assert attempt["outcome"] == "failed" and "SIGABRT" in attempt["outcome_detail"], attempt
    first = report.split("\n\n")[1]
    assert first.startswith("**How the job ended**: failed: rank 2") and "SIGABRT" in first, first


def test_a_shared_stderr_is_not_read_and_the_verdict_says_where_to_look(
    server: Server, tmp_path: Path
) -> None:
    crash(server, tmp_path, "crash-shared", redirects=False)  # every rank's fd 2: one pipe
    view = wait_for(
        lambda: (
            (v := server.get("/api/v1/runs/crash-shared/collectives").json()).get("crashes") and v
        ),
        30,
        "the crash in the collectives view",
    )
    crash_2 = view["crashes"]["2"]
    assert crash_2["signal"] == "SIGABRT" and crash_2["cause"] is None
    assert "--redirects 2" in crash_2["cause_note"], crash_2
    print(view["verdict"]["summary"])
    assert MISMATCH not in view["verdict"]["summary"]
