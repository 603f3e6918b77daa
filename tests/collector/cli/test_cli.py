"""The ``trainwarden`` command as a user runs it (real subprocesses)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, inspect

from ...helpers import start_serve, stop_serve
from ...net import free_port


def trainwarden(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainwarden.collector.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_serve_with_an_unreachable_database_exits_with_one_line_and_no_password() -> None:
    port = free_port()  # nothing listens there
    url = f"postgresql+psycopg://trainer:s3cret-pw@127.0.0.1:{port}/tw"
    result = trainwarden("serve", "--db", url, "--port", str(free_port()))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("trainwarden: error: cannot connect to database")
    assert f"postgresql+psycopg://trainer:***@127.0.0.1:{port}/tw" in lines[0]
    assert "s3cret-pw" not in result.stderr + result.stdout


def test_a_malformed_database_url_is_named() -> None:
    result = trainwarden("db", "upgrade", "--db", "not a url")
    assert result.returncode == 2
    assert "database URL 'not a url' is not valid" in result.stderr


def test_db_upgrade_creates_the_schema(db_url: str) -> None:
    result = trainwarden("db", "upgrade", "--db", db_url)
    assert result.returncode == 0, result.stderr
    assert "latest schema" in result.stdout
    tables = set(inspect(create_engine(db_url)).get_table_names())
    assert {"runs", "ranks", "rank_steps", "step_stats", "events", "alembic_version"} <= tables


def test_default_database_is_an_sqlite_file_in_the_user_data_dir(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.delenv("TRAINWARDEN_DB", raising=False)
    result = trainwarden("db", "upgrade")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "trainwarden" / "trainwarden.db").exists()


def test_serve_logs_each_request_only_with_access_log_at_info(tmp_path: Path) -> None:
    # uvicorn's access log is off unless asked for (a line for every rank's request each
    # second), and above info it stays off (it would format a line a request it drops).
    db = f"sqlite:///{tmp_path / 'tw.db'}"
    for level, args, logged in (
        ("info", (), False),
        ("info", ("--access-log",), True),
        ("warning", ("--access-log",), False),
    ):
        log = tmp_path / f"serve-{level}-{len(args)}.log"
        server = start_serve(db, log, log_level=level, args=args)
        try:
            assert httpx.get(server.url + "/api/v1/runs", timeout=10).status_code == 200
        finally:
            stop_serve(server)
        assert ('"GET /api/v1/runs HTTP/1.1" 200' in log.read_text()) is logged, log.read_text()


def test_demo_refuses_a_bad_actions_file_before_it_starts_anything(tmp_path: Path) -> None:
    bad = tmp_path / "actions.yaml"
    bad.write_text("rollback:\n  mode: sometimes\n")
    result = trainwarden(
        "demo",
        "--actions",
        str(bad),
        "--db",
        f"sqlite:///{tmp_path}/tw.db",
        "--port",
        str(free_port()),
        "--exit-when-done",
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert str(bad) in result.stderr and "rollback.mode" in result.stderr, result.stderr
    assert "dashboard" not in result.stdout  # nothing was started
    assert not (tmp_path / "tw.db").exists()


def test_the_demo_holds_the_port_it_names() -> None:
    """``demo --port 0``, or a taken port: the demo listens on a port the system picks
    and holds it from then on (its URLs name it); a taken port is refused, not shared."""
    from trainwarden.collector.cli.demo import listen

    with listen("127.0.0.1", 0) as held:
        port = held.getsockname()[1]
        assert port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it accepts already
        with pytest.raises(OSError):
            listen("127.0.0.1", port)


def test_the_demo_policy_runs_a_rollback_and_keeps_evictions_and_stops_dry() -> None:
    from trainwarden.collector.cli.demo import demo_policy

    policy = demo_policy()
    assert (policy.rollback.mode, policy.evict.mode, policy.stop.mode) == (
        "auto",
        "dry-run",
        "dry-run",
    )
