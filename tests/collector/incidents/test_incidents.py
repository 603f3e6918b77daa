"""Incidents, the logbook, timelines and post-mortem reports on a real database (SQLite
and PostgreSQL): grouping with a controlled clock, the operators' changes through the
API, the timeline's order and derived figures against the stored timestamps, and the
Markdown / JSON / HTML renderers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from trainwarden.collector.app import create_app
from trainwarden.collector.incidents.grouping import group
from trainwarden.collector.incidents.postmortem import report_of
from trainwarden.collector.incidents.report_format import render_markdown
from trainwarden.collector.incidents.report_html import render_html
from trainwarden.collector.incidents.timeline import timeline
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.settings import Settings
from trainwarden.collector.store.db import write

from .. import incident_scenario as sc
from ..incident_scenario import T0

COOLDOWN = 60.0


def run_pass(engine: Engine, now: float) -> Any:
    with write(engine) as conn:
        return group(conn, now=now, cooldown_s=COOLDOWN)


@pytest.fixture
def client(engine: Engine) -> Iterator[TestClient]:
    app = create_app(
        engine,
        Settings(price_per_gpu_hour=2.5),
        ui=False,
        health=None,
        rollups=False,
        alerting=None,
        act=False,
        incidents=False,
    )
    with TestClient(app) as c:
        yield c


# -- grouping ------------------------------------------------------------------------------------


def test_an_incident_opens_on_the_first_firing_alert_gathers_what_follows_and_closes_after_cooldown(
    engine: Engine, client: TestClient
) -> None:
    run_id = sc.make_run(engine)
    pending = sc.alert(engine, run_id, active_since=T0 + 10, fired_at=None, state="pending")
    assert run_pass(engine, T0 + 11).opened == []  # pending is not yet an incident
    first = sc.alert(engine, run_id, rank=0, active_since=T0 + 12, fired_at=T0 + 13)
    result = run_pass(engine, T0 + 14)
    assert len(result.opened) == 1
    (incident,) = client.get(f"/api/v1/runs/{sc.RUN}/incidents").json()
    assert (incident["title"], incident["state"], incident["alerts"]) == (
        "LossSpike on rank 0 (node0)",
        "open",
        [first],
    )
    assert incident["opened_at"] == T0 + 13 and pending not in incident["alerts"]

    # A second alert on another rank and the action it triggers join the same incident.
    second = sc.alert(
        engine,
        run_id,
        rule="RankHung",
        rank=1,
        active_since=T0 + 20,
        fired_at=T0 + 21,
        severity="warning",
    )
    act = sc.action(
        engine,
        run_id,
        alert_id=second,
        kind="stop",
        history=[(T0 + 22, "proposed"), (T0 + 22, "approved")],
    )
    early = sc.action(
        engine,
        run_id,
        alert_id=None,
        kind="stop",
        trigger="operator:ana",
        history=[(T0 + 1, "proposed"), (T0 + 1, "cancelled")],
    )
    assert run_pass(engine, T0 + 23).opened == []
    got = client.get(f"/api/v1/incidents/{incident['id']}").json()
    assert got["alerts"] == sorted([first, second]) and got["actions"] == [act]
    assert early not in got["actions"]  # an operator's action from before it opened
    assert (got["ranks"], got["nodes"], got["severity"]) == ([0, 1], ["node0", "node1"], "critical")

    # Everything resolves at T0+50 (the action ends at T0+40): closed a cool-down later.
    with write(engine) as conn:
        from sqlalchemy import update

        from trainwarden.collector.store import models as m

        conn.execute(
            update(m.alerts).values(state="resolved", resolved_at=T0 + 50, cleared_at=T0 + 45)
        )
        conn.execute(
            update(m.actions).where(m.actions.c.id == act).values(state="done", finished_at=T0 + 40)
        )
    assert run_pass(engine, T0 + 50 + COOLDOWN - 1).closed == []
    assert run_pass(engine, T0 + 50 + COOLDOWN).closed == [incident["id"]]
    got = client.get(f"/api/v1/incidents/{incident['id']}").json()
    assert (got["state"], got["closed_by"], got["closed_at"]) == (
        "closed",
        "trainwarden",
        T0 + 50 + COOLDOWN,
    )

    # The next alert that fires opens a new incident.
    third = sc.alert(engine, run_id, active_since=T0 + 200, fired_at=T0 + 200)
    assert len(run_pass(engine, T0 + 201).opened) == 1
    incidents = client.get(f"/api/v1/runs/{sc.RUN}/incidents").json()
    assert [i["alerts"] for i in incidents] == [sorted([first, second]), [third]]


def test_an_alert_firing_during_the_cooldown_keeps_the_incident_open(engine: Engine) -> None:
    run_id = sc.make_run(engine)
    sc.alert(engine, run_id, active_since=T0, fired_at=T0, state="resolved", resolved_at=T0 + 5)
    (opened,) = run_pass(engine, T0 + 6).opened
    sc.alert(engine, run_id, rank=1, active_since=T0 + 30, fired_at=T0 + 31)
    assert run_pass(engine, T0 + 5 + COOLDOWN).closed == []  # the new one is still firing
    assert run_pass(engine, T0 + 5 + COOLDOWN).opened == []


def test_a_more_severe_alert_that_joins_takes_over_the_title_unless_an_operator_gave_one(
    engine: Engine, client: TestClient
) -> None:
    run_id = sc.make_run(engine)
    sc.alert(
        engine, run_id, rule="StepTimeRegression", severity="warning", active_since=T0, fired_at=T0
    )
    (incident,) = run_pass(engine, T0 + 1).opened
    assert (
        client.get(f"/api/v1/incidents/{incident}").json()["title"]
        == "StepTimeRegression on rank 0 (node0)"
    )
    xid = sc.alert(engine, run_id, rule="FatalXid", rank=1, active_since=T0 + 30, fired_at=T0 + 30)
    run_pass(engine, T0 + 31)
    body = client.get(f"/api/v1/incidents/{incident}").json()
    assert (body["title"], body["severity"]) == ("FatalXid on rank 1 (node1)", "critical")
    assert (
        body["history"][-1]["what"] == "retitled"
        and f"alert {xid} (FatalXid" in body["history"][-1]["detail"]
    )
    # As severe, or less: the title stays.
    sc.alert(engine, run_id, rule="RankDead", rank=0, active_since=T0 + 40, fired_at=T0 + 40)
    run_pass(engine, T0 + 41)
    assert (
        client.get(f"/api/v1/incidents/{incident}").json()["title"] == "FatalXid on rank 1 (node1)"
    )

    # An operator's title is kept whatever joins.
    other = sc.make_run(engine, "other")
    sc.alert(engine, other, rule="Straggler", severity="info", active_since=T0, fired_at=T0)
    (named,) = run_pass(engine, T0 + 1).opened
    client.patch(f"/api/v1/incidents/{named}", json={"title": "node3 is slow", "by": "ana"})
    sc.alert(engine, other, rule="FatalXid", rank=1, active_since=T0 + 30, fired_at=T0 + 30)
    run_pass(engine, T0 + 31)
    body = client.get(f"/api/v1/incidents/{named}").json()
    assert (body["title"], body["severity"]) == ("node3 is slow", "critical")


def test_a_job_that_dies_whole_joins_one_incident_in_one_pass(
    engine: Engine, client: TestClient
) -> None:
    """A RankDead alert a rank, in one pass: every rank and node joins the incident, and
    the first critical alert titles it (they join together, not one statement each)."""
    run_id = sc.make_run(engine)
    sc.alert(
        engine, run_id, rule="Straggler", severity="warning", rank=5, active_since=T0, fired_at=T0
    )
    ids = [
        sc.alert(
            engine,
            run_id,
            rule="RankDead",
            rank=r,
            active_since=T0 + 20,
            fired_at=T0 + 20 + r / 100,
        )
        for r in range(40)
    ]
    (incident,) = run_pass(engine, T0 + 30).opened
    body = client.get(f"/api/v1/incidents/{incident}").json()
    assert (body["title"], body["severity"]) == ("RankDead on rank 0 (node0)", "critical")
    # In number order, as an on-call engineer reads them (not "node10" before "node2").
    assert body["ranks"] == list(range(40))
    assert body["nodes"] == [f"node{r}" for r in range(40)]
    joined = set(body["alerts"])
    assert set(ids) < joined and len(joined) == 41
    assert run_pass(engine, T0 + 31).joined == 0


# -- operators' changes ------------------------------------------------------------------------


def test_operators_open_retitle_merge_and_close_incidents(
    engine: Engine, client: TestClient
) -> None:
    run_id = sc.make_run(engine)
    sc.make_run(engine, "other")
    auto_alert = sc.alert(engine, run_id, active_since=T0 + 5, fired_at=T0 + 6)
    (auto,) = run_pass(engine, T0 + 7).opened
    loose = sc.alert(engine, run_id, rank=1, active_since=T0 + 2, fired_at=None, state="pending")

    opened = client.post(
        "/api/v1/incidents",
        json={"run": sc.RUN, "title": "NCCL timeouts on node1", "by": "ana", "alerts": [loose]},
    )
    assert opened.status_code == 201, opened.text
    manual = opened.json()
    assert (manual["auto"], manual["opened_by"], manual["opened_at"], manual["alerts"]) == (
        False,
        "ana",
        T0 + 2,
        [loose],
    )
    taken = client.post(
        "/api/v1/incidents", json={"run": sc.RUN, "title": "x", "by": "bo", "alerts": [auto_alert]}
    )
    assert taken.status_code == 409 and f"incident {auto}" in taken.json()["detail"]
    assert (
        client.post("/api/v1/incidents", json={"run": "nope", "title": "x", "by": "bo"}).status_code
        == 404
    )

    renamed = client.patch(
        f"/api/v1/incidents/{auto}", json={"title": "Loss spike at step 36", "by": "ana"}
    )
    assert renamed.json()["title"] == "Loss spike at step 36"
    assert renamed.json()["history"][-1]["what"] == "retitled"

    other = client.post(
        "/api/v1/incidents", json={"run": "other", "title": "elsewhere", "by": "ana"}
    ).json()
    cross = client.post(
        f"/api/v1/incidents/{auto}/merge", json={"incidents": [other["id"]], "by": "ana"}
    )
    assert cross.status_code == 422 and "other" in cross.json()["error"]
    merged = client.post(
        f"/api/v1/incidents/{auto}/merge", json={"incidents": [manual["id"]], "by": "ana"}
    )
    assert merged.status_code == 200, merged.text
    body = merged.json()
    assert body["alerts"] == sorted([auto_alert, loose]) and body["opened_at"] == T0 + 2
    assert body["ranks"] == [0, 1]
    gone = client.get(f"/api/v1/incidents/{manual['id']}").json()
    assert (gone["state"], gone["merged_into"], gone["alerts"]) == ("merged", auto, [])
    assert [i["id"] for i in client.get(f"/api/v1/runs/{sc.RUN}/incidents").json()] == [auto]
    again = client.post(
        f"/api/v1/incidents/{auto}/merge", json={"incidents": [manual["id"]], "by": "ana"}
    )
    assert again.status_code == 409

    closed = client.post(
        f"/api/v1/incidents/{auto}/close", json={"by": "ana", "summary": "bad batch"}
    )
    assert (closed.json()["state"], closed.json()["summary"], closed.json()["closed_by"]) == (
        "closed",
        "bad batch",
        "ana",
    )
    assert client.post(f"/api/v1/incidents/{auto}/close", json={"by": "ana"}).status_code == 409
    assert client.get("/api/v1/incidents/999").status_code == 404


def test_notes_join_the_open_incident_and_show_in_its_timeline(
    engine: Engine, client: TestClient
) -> None:
    run_id = sc.make_run(engine)
    before = client.post(
        f"/api/v1/runs/{sc.RUN}/notes",
        json={"author": "ana", "text": "starting the long job", "at": T0},
    )
    assert before.status_code == 201 and before.json()["incident"] is None
    sc.alert(engine, run_id, active_since=T0 + 500, fired_at=T0 + 500)
    (incident_id,) = run_pass(engine, T0 + 501).opened
    note = client.post(
        f"/api/v1/runs/{sc.RUN}/notes",
        json={"author": "bo", "text": "restarted node0's NIC", "at": T0 + 510, "step": 48},
    ).json()
    assert (note["incident"], note["author"], note["step"]) == (incident_id, "bo", 48)
    assert [n["text"] for n in client.get(f"/api/v1/runs/{sc.RUN}/notes").json()] == [
        "starting the long job",
        "restarted node0's NIC",
    ]
    bad = client.post(f"/api/v1/runs/{sc.RUN}/notes", json={"author": "bo", "text": ""})
    assert bad.status_code == 422
    assert (
        client.post("/api/v1/runs/nope/notes", json={"author": "bo", "text": "x"}).status_code
        == 404
    )
    t = client.get(f"/api/v1/runs/{sc.RUN}/timeline", params={"incident": incident_id}).json()
    notes = [e["text"] for e in t["entries"] if e["source"] == "note"]
    assert notes == ["bo: restarted node0's NIC"]  # the first one is long before the window


# -- the timeline and its figures --------------------------------------------------------------


def test_the_timeline_orders_a_rollback_incident_and_derives_its_figures_from_the_stored_times(
    engine: Engine, client: TestClient
) -> None:
    ids = sc.rollback_incident(engine)
    (incident_id,) = run_pass(engine, T0 + 80).opened
    t = client.get(f"/api/v1/runs/{sc.RUN}/timeline", params={"incident": incident_id}).json()
    assert t["incident"]["actions"] == [ids["action"]]
    keys = [(e["source"], e["kind"]) for e in t["entries"]]
    story = [
        ("event", "checkpoint"),
        ("event", "drill"),
        ("alert", "pending"),
        ("alert", "firing"),
        ("incident", "opened"),
        ("page", "delivered"),
        ("action", "proposed"),
        ("action", "approved"),
        ("action", "executing"),
        ("action", "executing"),
        ("action", "done"),
        ("derived", "recovered"),
        ("alert", "cleared"),
        ("alert", "resolved"),
    ]
    assert [k for k in keys if k in story] == story
    times = [e["at"] for e in t["entries"]]
    assert times == sorted(times)
    drill = next(e for e in t["entries"] if e["kind"] == "drill")
    assert (drill["at"], drill["step"], drill["node"]) == (sc.FAULT_AT, 35, "node0")
    assert "loss_spike=50x@step=35" in drill["text"]
    firing = next(e for e in t["entries"] if e["kind"] == "firing")
    assert (
        firing["runbook_url"] == "/runbooks/LossSpike"
        and firing["ui_url"] == f"/alerts?run={sc.RUN}"
    )
    # Each at the run's step when it happened (the alert held until step 39).
    pending = next(e for e in t["entries"] if e["kind"] == "pending")
    assert (pending["step"], firing["step"]) == (36, 37)
    done = next(e for e in t["entries"] if e["kind"] == "done")
    assert "restored checkpoint step 30 after step 40" in done["text"]
    recovered = next(e for e in t["entries"] if e["kind"] == "recovered")
    assert (recovered["at"], recovered["step"]) == (sc.RECOVERED_AT, 40)

    f = t["figures"]
    for key, value in sc.EXPECTED.items():
        assert f[key] == pytest.approx(value), key
    assert (f["fault_at"], f["pending_at"], f["paged_at"], f["acted_at"]) == (
        sc.FAULT_AT,
        sc.PENDING_AT,
        pytest.approx(sc.PAGED_AT),
        sc.EXECUTING_AT,
    )
    assert f["gpu_hours_lost"] == pytest.approx(2 * sc.EXPECTED["time_lost_s"] / 3600)
    assert f["cost"] == pytest.approx(2.5 * f["gpu_hours_lost"])  # the collector's price
    cheaper = client.get(
        f"/api/v1/runs/{sc.RUN}/timeline", params={"incident": incident_id, "price": 1.0}
    ).json()
    assert cheaper["figures"]["cost"] == pytest.approx(f["gpu_hours_lost"])

    whole = client.get(f"/api/v1/runs/{sc.RUN}/timeline").json()
    assert whole["figures"] is None and whole["incident"] is None
    assert {("alert", "firing"), ("action", "done"), ("event", "drill")} <= {
        (e["source"], e["kind"]) for e in whole["entries"]
    }
    assert (
        client.get(f"/api/v1/runs/{sc.RUN}/timeline", params={"incident": 999}).status_code == 404
    )


def test_a_dry_run_is_not_an_action_taken_and_a_missing_page_is_not_invented(
    engine: Engine,
) -> None:
    run_id = sc.make_run(engine)
    alert_id = sc.alert(
        engine,
        run_id,
        active_since=T0 + 20.5,
        fired_at=T0 + 21,
        state="resolved",
        cleared_at=T0 + 30,
        resolved_at=T0 + 30,
        step=20,
    )
    sc.action(
        engine,
        run_id,
        alert_id=alert_id,
        mode="dry-run",
        history=[(T0 + 21, "proposed"), (T0 + 21, "done")],
    )
    (incident_id,) = run_pass(engine, T0 + 22).opened
    with engine.connect() as conn:
        f = timeline(conn, run=sc.RUN, incident_id=incident_id, now=T0 + 100)["figures"]
    assert (f["page_s"], f["act_s"], f["cost"]) == (None, None, None)
    # No fault event: the fault is the alert's first anomalous step (20, at T0+20), and
    # recovery is when its condition cleared.
    assert f["fault_at"] == T0 + 20 and f["detect_s"] == pytest.approx(0.5)
    assert f["recovered_at"] == T0 + 30 and f["recover_s"] == pytest.approx(10.0)
    assert f["steps_lost"] == 0


# -- reports ---------------------------------------------------------------------------------------


def test_markdown_and_json_reports_tell_the_incident(engine: Engine, client: TestClient) -> None:
    sc.rollback_incident(engine)
    client.post(
        f"/api/v1/runs/{sc.RUN}/notes",
        json={"author": "ana", "text": "watching the loss", "at": T0 + 45},
    )
    run_pass(engine, T0 + 80)
    md = client.get(f"/api/v1/runs/{sc.RUN}/postmortem", params={"format": "md"})
    assert md.status_code == 200 and md.headers["content-type"].startswith("text/markdown")
    text = md.text
    assert text.startswith(f"# Post-mortem: run `{sc.RUN}`")
    assert "## Incident 1: LossSpike on rank 0 (node0) (open)" in text
    assert "- **Time to detect**: 0.8 s" in text and "- **Time to page**: 0.5 s" in text
    assert "- **Time to act**: 1.0 s" in text and "- **Steps lost**: 10" in text
    assert "at 2.5 per GPU-hour" in text
    assert "[runbook](/runbooks/LossSpike)" in text
    lines = text.splitlines()
    order = [
        next(i for i, line in enumerate(lines) if needle in line)
        for needle in (
            "— fault injected (drill)",
            "LossSpike pending",
            "LossSpike firing",
            "delivered to hook",
            "rollback executing",
            "rollback done",
            "recovered: step 40",
            "ana: watching the loss",
        )
    ]
    assert order == sorted(order)
    slack = render_markdown(
        client.get(f"/api/v1/runs/{sc.RUN}/postmortem", params={"format": "json"}).json(),
        flavor="slack",
    )
    assert "*Time to detect*: 0.8 s" in slack and "<" + "/runbooks/LossSpike|runbook>" in slack

    report = client.get(f"/api/v1/runs/{sc.RUN}/postmortem", params={"format": "json"}).json()
    assert report["kind"] == "trainwarden.postmortem" and report["run"]["world_size"] == 2
    (inc,) = report["incidents"]
    assert inc["figures"]["detect_s"] == pytest.approx(sc.EXPECTED["detect_s"])
    assert inc["charts"]["loss"]["step"] == list(range(1, 61))  # the window's steps
    assert set(inc["charts"]["temp_c"]) == {"0"}
    download = client.get(
        f"/api/v1/runs/{sc.RUN}/postmortem", params={"format": "html", "download": True}
    )
    assert 'filename="postmortem-spiky.html"' in download.headers["content-disposition"]


def test_a_run_without_incidents_gets_an_honest_report(engine: Engine, client: TestClient) -> None:
    sc.make_run(engine)
    md = client.get(f"/api/v1/runs/{sc.RUN}/postmortem").text
    assert "_0 incident(s);" in md and "No incidents: no alert of this run fired" in md
    assert "Time to detect" not in md
    report = client.get(f"/api/v1/runs/{sc.RUN}/postmortem", params={"format": "json"}).json()
    assert report["incidents"] == []
    html = client.get(f"/api/v1/runs/{sc.RUN}/postmortem", params={"format": "html"}).text
    assert "id='no-incidents'" in html and "<script>" not in html  # nothing to chart
    assert client.get("/api/v1/runs/nope/postmortem").status_code == 404


def test_the_html_report_is_self_contained(engine: Engine) -> None:
    sc.rollback_incident(engine)
    run_pass(engine, T0 + 80)
    with engine.connect() as conn:
        page = render_html(report_of(conn, run=sc.RUN, now=T0 + 100))
    assert page.startswith("<!DOCTYPE html>") and "Plotly.newPlot" in page
    assert "<script src=" not in page and "<link " not in page  # nothing to fetch
    assert "data-kind='recovered'" in page and "fault injected (drill)" in page
    # MFU as the run overview shows it: a percentage to two significant digits.
    assert '"tickformat":".2~p"' in page and "%{y:.2~p}" in page


def test_the_fault_is_one_on_the_alerts_ranks_not_an_earlier_one_elsewhere(engine: Engine) -> None:
    run_id = sc.make_run(engine)
    sc.event(
        engine, run_id, "drill", T0 + 5, step=5, rank=0, data={"spec": "thermal=90C@rank=0,step=5"}
    )
    sc.event(engine, run_id, "xid", T0 + 9, step=9, rank=1, data={"code": 79})
    sc.alert(
        engine, run_id, rule="FatalXid", rank=1, active_since=T0 + 10, fired_at=T0 + 10, step=9
    )
    (incident_id,) = run_pass(engine, T0 + 11).opened
    with engine.connect() as conn:
        f = timeline(conn, run=sc.RUN, incident_id=incident_id, now=T0 + 20)["figures"]
    assert (f["fault_at"], f["fault"], f["detect_s"]) == (T0 + 9, "XID 79 on GPU ?", 1.0)


# -- attempts and goodput -------------------------------------------------------------------------


def test_attempts_start_and_end_in_the_timeline_and_the_report_has_the_goodput(
    engine: Engine, client: TestClient
) -> None:
    from .. import economics_scenario as econ

    def post(body: dict[str, Any]) -> None:
        assert client.post("/api/v1/ingest", json=body).status_code == 200

    t0 = econ.seed(post)
    flush(engine, now=time.time(), grace_s=0)  # the step rollups goodput reads
    tl = client.get(f"/api/v1/runs/{econ.RUN}/timeline").json()
    mine = [
        (e["kind"], e["text"], e["severity"]) for e in tl["entries"] if e["source"] == "attempt"
    ]
    assert mine == [
        ("started", "attempt 1 started: world size 2 on gpu-node0, gpu-node1", "info"),
        (
            "ended",
            "attempt 1 ended (exception): rank 1 on gpu-node1 at step 155: RuntimeError: "
            "CUDA error: an illegal memory access was encountered (then: sigterm)",
            "critical",
        ),
        (
            "started",
            "attempt 2 started: world size 2 on gpu-node0, gpu-node1; resumed at step 144",
            "info",
        ),
    ]
    ended = next(e for e in tl["entries"] if e["source"] == "attempt" and e["kind"] == "ended")
    assert ended["at"] == pytest.approx(econ.at_step(t0 + 120, 0, 155) + 15)  # rank 0's SIGTERM
    assert (ended["step"], ended["ui_url"]) == (155, f"/runs/{econ.RUN}/info")
    # One entry per attempt, not one per rank's attempt_start / attempt_end event.
    assert not [e for e in tl["entries"] if e["kind"] in ("attempt_start", "attempt_end")]

    md = client.get(f"/api/v1/runs/{econ.RUN}/postmortem").text
    report = client.get(f"/api/v1/runs/{econ.RUN}/postmortem", params={"format": "json"}).json()
    g = report["goodput"]
    assert (g["attempts"], g["interruptions"]) == (2, 1) and 0 < g["ettr"] < 1
    line = next(x for x in md.splitlines() if x.startswith("**Goodput**"))
    assert f"ETTR {g['ettr']:.1%}" in line and "2 attempt(s) (1 interruption(s)" in line
    assert f"lost {g['gpu_hours']['lost']:.3f}" in line and "at 2.5 per GPU-hour" in line
    page = client.get(f"/api/v1/runs/{econ.RUN}/postmortem", params={"format": "html"}).text
    assert "<p id='goodput'><b>Goodput</b>: ETTR" in page
    # A report from an older collector (no goodput) renders as before.
    assert "Goodput" not in render_markdown({**report, "goodput": None})
