"""The packaging a user relies on: the console script, the Docker image, compose."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib
import yaml
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[1]


def test_console_script_is_installed_and_lists_the_commands() -> None:
    exe = Path(sys.executable).with_name("trainwarden")
    assert exe.exists() or shutil.which("trainwarden")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("serve", "demo", "db"):
        assert command in out


def test_dockerfile_copies_every_packaged_folder() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {
        path.split("/")[0] for path in pyproject["tool"]["setuptools"]["package-dir"].values()
    }
    copied = set(re.findall(r"^COPY (\S+) \./", (ROOT / "Dockerfile").read_text(), flags=re.M))
    assert folders <= copied, f"Dockerfile misses {folders - copied}"


def test_compose_runs_postgres_and_points_trainwarden_at_it() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "trainwarden"}
    url = make_url(services["trainwarden"]["environment"]["TRAINWARDEN_DB"])
    pg_env = services["postgres"]["environment"]
    assert url.drivername == "postgresql+psycopg" and url.host == "postgres"
    assert (url.username, url.password, url.database) == (
        pg_env["POSTGRES_USER"],
        pg_env["POSTGRES_PASSWORD"],
        pg_env["POSTGRES_DB"],
    )
    assert services["trainwarden"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["trainwarden"]["ports"] == ["8000:8000"]
