"""The packaging a user relies on: the console script, the Docker image, compose."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

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


def test_every_python_package_folder_is_in_the_wheel() -> None:
    # `packages` is a list: a new subpackage left out of it works in a checkout (the
    # editable install finds its folder) and is missing from a wheel and the image.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    for package in (
        "trainwarden.agent",
        "trainwarden.alerts",
        "trainwarden.collector",
        "trainwarden.webui",
    ):
        base = ROOT / pyproject["tool"]["setuptools"]["package-dir"][package]
        for init in base.rglob("__init__.py"):
            sub = init.parent.relative_to(base).parts
            name = ".".join((package, *sub))
            assert name in listed, f"{name} ({init.parent}) is not in pyproject's packages"


def test_every_data_file_the_packages_read_is_in_the_wheel() -> None:
    # package-data globs do not recurse: a file in a new subfolder (the vendored plotly.js)
    # would be missing from a wheel, and from the Docker image, while a checkout works.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]
    dirs = pyproject["tool"]["setuptools"]["package-dir"]
    for folder, package in (
        ("webui/assets", "trainwarden.webui"),
        ("agent/data", "trainwarden.agent"),
        ("alerts/rules", "trainwarden.alerts"),
    ):
        base = ROOT / dirs[package]
        for path in (ROOT / folder).rglob("*"):
            if path.is_file():
                rel = path.relative_to(base).as_posix()
                here = PurePosixPath(rel)
                whole = [g for g in data[package] if len(PurePosixPath(g).parts) == len(here.parts)]
                assert any(here.match(g) for g in whole), (
                    f"{rel} is not in package-data {data[package]}"
                )


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
