"""``trainwarden note`` and ``trainwarden postmortem`` as a user runs them, against a real
``trainwarden serve`` (its incident engine groups the drill's rows), posting to a real
local HTTP receiver; and the engine posting a report when an incident closes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import Engine

from trainwarden.collector.incidents.engine import IncidentEngine
from trainwarden.collector.incidents.store import IncidentSettings
from trainwarden.collector.store.db import make_engine

from ...helpers import Server, wait_for
from ...receivers import Receiver
from .. import incident_scenario as sc


def trainwarden(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainwarden.collector.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


# The report on both databases: tests/collector/incidents/test_incidents.py.
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_note_and_postmortem_through_a_collector_with_a_failing_and_a_working_webhook(
    live_server: Server, db_url: str, tmp_path: Path
) -> None:
    engine = make_engine(db_url)
    sc.rollback_incident(engine)
    engine.dispose()
    url = live_server.url
    wait_for(lambda: live_server.get(f"/api/v1/runs/{sc.RUN}/incidents").json(), 30, "the incident")

    noted = trainwarden(
        "note", sc.RUN, "rolled back by hand? no: auto", "--author", "ana", "--url", url
    )
    assert noted.returncode == 0, noted.stderr
    assert noted.stdout.startswith(f"trainwarden: note 1 added to run {sc.RUN}")
    (note,) = live_server.get(f"/api/v1/runs/{sc.RUN}/notes").json()
    assert (note["author"], note["text"]) == ("ana", "rolled back by hand? no: auto")

    recv = Receiver()
    recv.answer("/down", 500)
    try:
        out = tmp_path / "report.md"
        failed = trainwarden(
            "postmortem",
            sc.RUN,
            "--format",
            "md",
            "--out",
            str(out),
            "--post",
            recv.url("/down"),
            "--url",
            url,
        )
        assert failed.returncode == 1
        assert "posting the report to http://127.0.0.1:" in failed.stderr
        assert "failed: HTTP 500: bad day at the receiver" in failed.stderr
        assert out.read_text().startswith(f"# Post-mortem: run `{sc.RUN}`")  # still written
        assert "- **Time to detect**: 0.8 s" in out.read_text()

        out = tmp_path / "report.json"
        posted = trainwarden(
            "postmortem",
            sc.RUN,
            "--format",
            "json",
            "--out",
            str(out),
            "--post",
            recv.url("/hook"),
            "--price-per-gpu-hour",
            "3",
            "--url",
            url,
        )
        assert posted.returncode == 0, posted.stderr
        assert "report posted to http://127.0.0.1:" in posted.stderr
        written = json.loads(out.read_text())
        (got,) = recv.got("/hook")
        assert got.body["report"]["incidents"][0]["figures"] == written["incidents"][0]["figures"]
        assert written["incidents"][0]["figures"]["price_per_gpu_hour"] == 3.0
        assert "charts" not in got.body["report"]["incidents"][0]  # a webhook gets no chart data
        assert got.body["text"].startswith(f"# Post-mortem: run `{sc.RUN}`")

        slack = trainwarden(
            "postmortem", sc.RUN, "--post", recv.url("/slack"), "--post-kind", "slack", "--url", url
        )
        assert slack.returncode == 0, slack.stderr
        assert slack.stdout.startswith(f"# Post-mortem: run `{sc.RUN}`")  # no --out: stdout
        (chat,) = recv.got("/slack")
        assert set(chat.body) == {"text"} and chat.body["text"].startswith(
            f"*Post-mortem: run `{sc.RUN}`*"
        )
    finally:
        recv.close()

    direct = trainwarden("postmortem", sc.RUN, "--db", db_url)  # the collector's database itself
    assert direct.returncode == 0, direct.stderr
    assert "LossSpike firing" in direct.stdout and "rolled back by hand" in direct.stdout
    missing = trainwarden("postmortem", "nope", "--url", url)
    assert missing.returncode == 2 and "run 'nope' not found" in missing.stderr
    down = trainwarden("note", sc.RUN, "x", "--url", "http://127.0.0.1:9")
    assert down.returncode == 2 and "cannot reach the collector at 127.0.0.1:9" in down.stderr


def test_the_engine_posts_the_report_of_an_incident_when_it_closes(engine: Engine) -> None:
    recv = Receiver()
    try:
        sc.rollback_incident(engine)  # everything resolved at T0+75
        clock = [sc.T0 + 76]
        incidents = IncidentEngine(
            engine,
            IncidentSettings(cooldown_s=60, post_url=recv.url("/hook")),
            clock=lambda: clock[0],
        )
        (opened,) = incidents.run_once().opened
        assert recv.got("/hook") == []  # open: nothing to post yet
        clock[0] = sc.T0 + 75 + 60
        assert incidents.run_once().closed == [opened]
        (got,) = recv.got("/hook")
        assert got.body["report"]["incidents"][0]["incident"]["state"] == "closed"
        assert "LossSpike firing" in got.body["text"]
        incidents.run_once()
        assert len(recv.got("/hook")) == 1  # posted once
        with engine.connect() as conn:
            from trainwarden.collector.incidents.store import get_incident

            assert get_incident(conn, incident_id=opened)["post_status"] == "posted (HTTP 200)"
    finally:
        recv.close()
