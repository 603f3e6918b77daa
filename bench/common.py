"""What the benchmarks share: a scratch PostgreSQL database and a real ``trainwarden serve``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import psycopg
from sqlalchemy.engine import make_url

DEFAULT_DB = os.environ.get(
    "TRAINWARDEN_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@contextmanager
def scratch_database(db_url: str) -> Iterator[tuple[str, str]]:
    """A fresh database on the server of ``db_url``, dropped afterwards.

    Yields (SQLAlchemy URL, libpq DSN) of the new database.
    """
    base = make_url(db_url)
    admin = base.set(drivername="postgresql").render_as_string(hide_password=False)
    name = f"tw_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield (
            base.set(database=name).render_as_string(hide_password=False),
            base.set(drivername="postgresql", database=name).render_as_string(hide_password=False),
        )
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def serving(db_url: str, *, log_name: str, auth: bool = False) -> Iterator[str]:
    """``trainwarden serve`` on ``db_url`` and a free loopback port; yields its URL.

    Its output goes to a file in the temp directory named after ``log_name``. Auth is off
    unless ``auth`` (bench/auth_cost.py measures what tokens cost).
    """
    with serving_process(db_url, log_name=log_name, auth=auth) as (url, _proc):
        yield url


def wait_healthy(url: str, log: str, timeout_s: float = 30.0) -> None:
    """Until ``url``'s ``/healthz`` answers 200 (a ``serve`` starting); ``log``: where
    it writes, for the error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"trainwarden serve did not start; see {log}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far, all its threads (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """:func:`cpu_seconds` of ``pid`` and of its living children (``serve --workers N``:
    the parent and its N workers)."""
    total = cpu_seconds(pid)
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        kids = []
    for kid in kids:
        try:
            total += cpu_seconds(kid)
        except OSError:  # gone meanwhile
            continue
    return total


def postgres_cpu_seconds() -> float:
    """CPU seconds used so far by the machine's PostgreSQL processes (its backends and
    background workers, whatever their database): the server is on this machine."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                if not f.read().startswith("postgres"):
                    continue
            total += cpu_seconds(int(entry))
        except OSError:  # gone meanwhile
            continue
    return total


@contextmanager
def serving_process(
    db_url: str, *, log_name: str, auth: bool = False
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """:func:`serving`, yielding the URL and the ``serve`` process (for its CPU time)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(tempfile.gettempdir(), f"trainwarden-{log_name}.log"), "w")  # noqa: SIM115
    cmd = [
        sys.executable,
        "-m",
        "trainwarden.collector.cli",
        "serve",
        "--db",
        db_url,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--auth",
        "required" if auth else "off",
    ]
    serve = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, log.name)
        yield url, serve
    finally:
        serve.terminate()
        serve.wait(10)
        log.close()
