"""Every node's record across runs (``collector/read/nodes.py``, ``GET /api/v1/nodes``,
``trainwarden nodes``), on SQLite and PostgreSQL: alerts with a ``finding`` label,
evictions, hang culprits and crash loops implicate their nodes; a clearance stops
counting what came before it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from trainwarden.collector.app import create_app
from trainwarden.collector.cli.nodes import slurm_hostlist
from trainwarden.collector.incidents.postmortem import render, report_of

from ..node_findings import HOUR, NOW, add_alert, add_event, add_eviction, add_run


@pytest.fixture
def fleet(engine):  # type: ignore[no-untyped-def]
    """Two runs a day apart on gpu-[01-04]. gpu-03: an XID in run a, a hang culprit in run
    b. gpu-02: an eviction in b. gpu-04: a crash loop in b and a thermal alert in a. gpu-01:
    an alert without a finding label (RankDead: a victim, not a finding) and an old XID."""
    with engine.begin() as conn:
        a = add_run(conn, "a", {0: "gpu-01", 1: "gpu-03", 2: "gpu-04"})
        b = add_run(conn, "b", {0: "gpu-02", 1: "gpu-03"})
        add_alert(conn, a, "FatalXid", "gpu-03", NOW - 30 * HOUR, finding="xid")
        add_alert(conn, a, "GpuThermalThrottle", "gpu-04", NOW - 29 * HOUR, finding="thermal")
        add_alert(conn, a, "RankDead", "gpu-01", NOW - 28 * HOUR)
        add_alert(conn, a, "FatalXid", "gpu-01", NOW - 10 * 24 * HOUR, finding="xid")
        add_event(
            conn,
            b,
            "hang_verdict",
            NOW - 5 * HOUR,
            {"kind": "culprit", "culprits": [1], "summary": "rank 1 never entered all_reduce"},
        )
        add_event(conn, b, "hang_verdict", NOW - 4 * HOUR, {"kind": "none", "culprits": []})
        add_event(
            conn,
            b,
            "crash_loop",
            NOW - 3 * HOUR,
            {"nodes": ["gpu-04"], "reason": "attempts 1-3 each failed at step 12"},
        )
        add_eviction(conn, b, "gpu-02", NOW - 2 * HOUR)
        add_eviction(conn, b, "gpu-01", NOW - HOUR, mode="dry-run")  # not an eviction done
    return engine


@pytest.fixture
def client(fleet):  # type: ignore[no-untyped-def]
    with TestClient(create_app(fleet, ui=False, health=None, rollups=False)) as c:
        yield c


def test_each_node_is_listed_with_its_findings_across_runs(client: TestClient) -> None:
    listed = client.get("/api/v1/nodes").json()
    assert [(n["node"], n["findings"], n["runs"], n["kinds"]) for n in listed] == [
        ("gpu-04", 2, 2, {"thermal": 1, "crash_loop": 1}),  # the newest finding first
        ("gpu-03", 2, 2, {"xid": 1, "hang": 1}),
        ("gpu-02", 1, 1, {"eviction": 1}),
    ]
    assert len(listed[0]["times"]) == 2 and listed[0]["cleared_at"] is None
    # gpu-01's XID is 10 days old: it is back in a longer window
    longer = {
        n["node"]: n["kinds"] for n in client.get("/api/v1/nodes", params={"days": 30}).json()
    }
    assert longer["gpu-01"] == {"xid": 1}
    assert client.get("/api/v1/nodes", params={"days": 0}).status_code == 422


def test_a_nodes_record_links_each_finding_to_its_run_and_step(client: TestClient) -> None:
    got = client.get("/api/v1/nodes/gpu-03").json()
    assert got["node"] == "gpu-03" and got["clearances"] == []
    assert [(f["kind"], f["run"], f["rank"], f["step"], f["cleared"]) for f in got["findings"]] == [
        ("xid", "a", 1, 40, False),
        ("hang", "b", 1, 12, False),
    ]
    assert got["findings"][1]["detail"] == "rank 1 never entered all_reduce"
    assert client.get("/api/v1/nodes/nowhere").json()["findings"] == []


def test_a_cleared_node_keeps_its_record_but_no_longer_counts(client: TestClient) -> None:
    said = client.post("/api/v1/nodes/gpu-03/clear", json={"by": "ana", "note": "GPU replaced"})
    assert said.status_code == 201, said.text
    assert [n["node"] for n in client.get("/api/v1/nodes").json()] == ["gpu-04", "gpu-02"]
    got = client.get("/api/v1/nodes/gpu-03").json()
    assert [f["cleared"] for f in got["findings"]] == [True, True]
    assert [(c["by"], c["note"]) for c in got["clearances"]] == [("ana", "GPU replaced")]
    bad = client.post("/api/v1/nodes/gpu-04/clear", json={"by": "ana", "note": ""})
    assert bad.status_code == 422 and "note" in bad.text


def test_the_cli_prints_an_exclude_list_and_clears_a_node(fleet, db_url: str) -> None:  # type: ignore[no-untyped-def]
    def nodes(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "trainwarden.collector.cli", "nodes", *args, "--db", db_url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert nodes("exclude", "--format", "slurm") == "--exclude=gpu-[03-04]\n"
    assert nodes("exclude", "--format", "k8s", "--min-findings", "1") == (
        "kubectl cordon gpu-02\nkubectl cordon gpu-03\nkubectl cordon gpu-04\n"
    )
    assert nodes("exclude", "--since", "36h", "--min-runs", "2") == "gpu-03\ngpu-04\n"
    assert "node gpu-04 cleared by" in nodes("clear", "gpu-04", "--note", "fan fixed")
    assert nodes("exclude", "--format", "plain") == "gpu-03\n"


def test_a_slurm_host_list_is_compressed_as_slurm_writes_it() -> None:
    assert slurm_hostlist(["node03", "node17", "node18", "node04"]) == "node[03-04,17-18]"
    assert slurm_hostlist(["n1", "n2", "n3", "n5", "login", "a9"]) == "a9,login,n[1-3,5]"
    assert slurm_hostlist(["node9", "node10"]) == "node10,node9"  # widths differ: two names
    assert slurm_hostlist([]) == ""


def test_a_post_mortem_names_the_runs_nodes_that_other_runs_found_bad(fleet) -> None:  # type: ignore[no-untyped-def]
    with fleet.begin() as conn:
        add_run(conn, "c", {0: "gpu-03", 1: "gpu-09"})
    with fleet.connect() as conn:
        report = report_of(conn, run="c", now=NOW, charts=False)
        own = report_of(conn, run="a", now=NOW, charts=False)["nodes_elsewhere"]
    (said,) = report["nodes_elsewhere"]
    assert (said["node"], said["runs"], said["kinds"]) == (
        "gpu-03",
        ["a", "b"],
        {"xid": 1, "hang": 1},
    )
    assert said["summary"] == (
        "gpu-03 was implicated in 2 other runs in the 7 days before this report "
        "(hang 1, xid 1): a, b"
    )
    assert [n["node"] for n in own] == ["gpu-03", "gpu-04"]  # run a's own findings left out
    assert own[0]["runs"] == ["b"]
    for fmt in ("md", "html"):
        assert "Nodes implicated in other runs" in render(report, fmt)
