"""Runbooks served rendered, the loaded rules with their runbook links, and
``serve --rules`` refusing a bad rules file with an error that names what is wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from trainwarden.alerts import RUNBOOKS_DIR, load_rule_packs
from trainwarden.collector.app import create_app
from trainwarden.collector.settings import Settings

from ...helpers import start_serve, stop_serve

MY_RULES = """\
rules:
  - name: MyTeamExposedComm
    kind: threshold
    summary: Our own, stricter budget for exposed communication.
    params: {scope: run, metric: exposed_comm_frac, stat: total, window: 20 steps, above: 0.1}
    for: 5m
    severity: info
    runbook: MyTeamExposedComm.md
"""


@pytest.fixture
def client(engine) -> TestClient:  # type: ignore[no-untyped-def]
    settings = Settings(db=str(engine.url), external_url="https://tw.example.org/")
    return TestClient(create_app(engine, settings, ui=False, health=None, rollups=False))


def test_every_rules_runbook_is_served_rendered(client: TestClient) -> None:
    rules = client.get("/api/v1/rules").json()
    assert len(rules) == len(load_rule_packs())  # the shipped pack
    for rule in rules:
        name = rule["runbook"].removesuffix(".md")
        assert rule["runbook_url"] == f"https://tw.example.org/runbooks/{name}"
        page = client.get(f"/runbooks/{name}")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert (
            f"<h1>{name}</h1>" in page.text and "<pre><code" in page.text
        )  # commands render as code
        assert "<h2>Diagnose</h2>" in page.text
    source = client.get("/runbooks/RankDead", params={"format": "md"})
    assert source.text == (RUNBOOKS_DIR / "RankDead.md").read_text()


def test_the_index_lists_runbooks_with_their_rules(client: TestClient) -> None:
    page = client.get("/runbooks").text
    assert page.count("<li>") == len(list(RUNBOOKS_DIR.glob("*.md")))
    assert '<a href="/runbooks/FatalXid">FatalXid</a> — rules: FatalXid' in page


@pytest.mark.parametrize("name", ["NoSuchRule", "..%2F..%2Fpyproject", "pyproject.toml", ".hidden"])
def test_unknown_or_unsafe_names_are_404(client: TestClient, name: str) -> None:
    response = client.get(f"/runbooks/{name}")
    assert response.status_code == 404  # (a path with slashes does not even reach the route)
    assert (
        client.get("/runbooks/NoSuchRule").json()["detail"].endswith("see /runbooks for the list")
    )


def test_raw_html_in_a_runbook_is_shown_as_text(engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "Sneaky.md").write_text("# Sneaky\n\n<script>alert(1)</script>\n")
    app = create_app(engine, ui=False, health=None, rollups=False, runbook_dirs=[tmp_path])
    page = TestClient(app).get("/runbooks/Sneaky").text
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page


def trainwarden(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainwarden.collector.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serve_refuses_a_bad_rules_file_naming_file_rule_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "mine.yaml"
    bad.write_text(MY_RULES.replace("for: 5m", "for: 5 parsecs"))
    result = trainwarden("serve", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--rules", str(bad))
    assert result.returncode == 2
    assert "mine.yaml" in result.stderr and "MyTeamExposedComm" in result.stderr
    assert "for:" in result.stderr and "5 parsecs" in result.stderr
    # A rule whose runbook does not exist is refused too.
    bad.write_text(MY_RULES)
    result = trainwarden("serve", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--rules", str(bad))
    assert result.returncode == 2 and "MyTeamExposedComm.md" in result.stderr


def test_serve_loads_your_rules_and_serves_your_runbooks(tmp_path: Path) -> None:
    (tmp_path / "runbooks").mkdir()
    (tmp_path / "runbooks" / "MyTeamExposedComm.md").write_text(
        "# MyTeamExposedComm\n\nPage Ana.\n"
    )
    (tmp_path / "mine.yaml").write_text(MY_RULES)
    server = start_serve(
        f"sqlite:///{tmp_path / 'tw.db'}",
        tmp_path / "serve.log",
        env={"TRAINWARDEN_RULES": str(tmp_path / "mine.yaml")},
    )
    try:
        names = [r["name"] for r in server.get("/api/v1/rules").json()]
        assert (
            "MyTeamExposedComm" in names
            and "RankDead" in names
            and len(names) == len(load_rule_packs()) + 1
        )
        page = server.get("/runbooks/MyTeamExposedComm")
        assert page.status_code == 200 and "Page Ana." in page.text
    finally:
        stop_serve(server)
    assert (
        len(load_rule_packs([tmp_path / "mine.yaml"], runbooks_dirs=[tmp_path / "runbooks"]))
        == len(load_rule_packs()) + 1
    )
