"""``trainwarden token create|list|revoke`` against a real ``trainwarden serve`` (auth as
shipped): a created token works, ``list`` never shows a secret, a revoked token is
refused within the collector's token cache time."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ...helpers import create_token, start_serve, stop_serve


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainwarden.collector.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


# The token store on both databases: tests/collector/api/test_auth.py.
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_create_list_and_revoke_against_a_running_collector(db_url: str, tmp_path: Path) -> None:
    server = start_serve(db_url, tmp_path / "serve.log", auth=True)
    try:
        viewer = create_token(db_url, "grafana", "read")
        assert viewer.startswith("tw_")
        runs = httpx.get(f"{server.url}/api/v1/runs", headers={"Authorization": f"Bearer {viewer}"})
        assert runs.status_code == 200
        assert httpx.get(f"{server.url}/api/v1/runs").status_code == 401

        taken = cli("token", "create", "grafana", "--scope", "read", "--db", db_url)
        assert taken.returncode == 2 and "exists" in taken.stderr
        wrong = cli("token", "create", "x", "--scope", "read", "--runs", "a-*", "--db", db_url)
        assert wrong.returncode == 2 and "--scope ingest" in wrong.stderr

        listed = cli("token", "list", "--db", db_url)
        assert listed.returncode == 0, listed.stderr
        assert "grafana" in listed.stdout and "read" in listed.stdout
        assert viewer not in listed.stdout and viewer.split("_", 2)[2] not in listed.stdout

        revoked = cli("token", "revoke", "grafana", "--db", db_url)
        assert revoked.returncode == 0, revoked.stderr
        # serve caches a token for 5 s: refused within that (with room for a busy machine).
        deadline = time.monotonic() + 60
        status = 200
        while time.monotonic() < deadline and status == 200:
            time.sleep(0.5)
            status = httpx.get(
                f"{server.url}/api/v1/runs", headers={"Authorization": f"Bearer {viewer}"}
            ).status_code
        assert status == 401
        assert "grafana" not in cli("token", "list", "--db", db_url).stdout
        assert "grafana" in cli("token", "list", "--all", "--db", db_url).stdout
        again = cli("token", "revoke", "grafana", "--db", db_url)
        assert again.returncode == 2 and "no live token" in again.stderr
    finally:
        stop_serve(server)
