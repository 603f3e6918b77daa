"""Helpers the tests share (imported, where fixtures are not enough): a real
``trainwarden serve`` started and stopped as a user runs it, API tokens, databases of a
test's own. The fixtures that use them are in ``conftest.py``."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from trainwarden.collector.store import models
from trainwarden.collector.store.db import make_engine, upgrade

from . import warm

ROOT = Path(__file__).resolve().parents[1]
"""The repository's root."""


@contextlib.contextmanager
def new_database(server: str, prefix: str, *, migrate: bool = True) -> Iterator[str]:
    """A database created on ``server`` for the caller (at the latest schema unless
    ``migrate`` is false), dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(server).set(database=name).render_as_string(hide_password=False)
    try:
        if migrate:
            engine = make_engine(url)
            upgrade(engine)
            engine.dispose()
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def empty_tables(url: str) -> None:
    """Every table of the PostgreSQL database ``url`` emptied, as the next test of the
    session expects it."""
    engine = create_engine(url)
    with engine.begin() as conn:
        tables = ", ".join(t.name for t in models.metadata.sorted_tables)
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    engine.dispose()


class Server:
    def __init__(self, url: str, proc: warm.Process, log: Path, token: str | None = None) -> None:
        self.url = url
        self.proc = proc
        self.log = log
        self.token = token  # an admin token when started with auth=True

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def get(self, path: str, **params: object) -> httpx.Response:
        return httpx.get(self.url + path, params=params, headers=self.headers, timeout=10)


def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The ``db_url`` fixtures' database: ``request.param`` is ``"sqlite"`` (a file in
    ``tmp_path``) or ``"postgres"`` (the session's database, its tables emptied after)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tw.db'}"
        return
    if request.param != "postgres":
        raise ValueError(f"db_url: {request.param!r} is not 'sqlite' or 'postgres'")
    url = request.getfixturevalue("pg_url")
    yield url
    empty_tables(url)


def create_token(db_url: str, name: str, *scopes: str, runs: str = "*") -> str:
    """``trainwarden token create`` as an operator runs it (forked warm: tests/warm.py);
    returns the printed token."""
    cmd = [
        sys.executable,
        "-m",
        "trainwarden.collector.cli",
        "token",
        "create",
        name,
        "--db",
        db_url,
        "--runs",
        runs,
        *(f"--scope={s}" for s in scopes),
    ]
    result = warm.run(cmd, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()[-1]


def start_serve(
    db_url: str,
    log: Path,
    *,
    env: dict[str, str] | None = None,
    port: int | None = None,
    auth: bool = False,
    log_level: str = "warning",
    args: tuple[str, ...] = (),
) -> Server:
    """``trainwarden serve`` as a user runs it: a real process on loopback (``args``: more
    of its options), forked from a process that has already imported the collector
    (tests/warm.py; ``--workers``, or ``TRAINWARDEN_TEST_WARM=0``: started fresh).

    Tests that are not about access run it with ``--auth off`` (they send and read as
    anyone may then); ``auth=True`` runs it as shipped (auth required) with an admin
    token made first by ``trainwarden token create``: ``Server.get`` sends it."""
    token = create_token(db_url, f"test-admin-{uuid.uuid4().hex[:6]}", "admin") if auth else None
    cmd = [
        sys.executable,
        "-m",
        "trainwarden.collector.cli",
        "serve",
        "--db",
        db_url,
        "--port",
        str(port or 0),  # 0: the system picks a free port, and serve says which
        "--log-level",
        log_level,
        "--auth",
        "required" if auth else "off",
        *args,
    ]
    with log.open("w") as out:  # forked warm (tests/warm.py) unless --workers
        proc = warm.popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    # The address this process listens on, from its own output: never another worker's
    # collector that happens to answer on a port chosen and released before.
    url = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}:\n{log.read_text()}")
        if not url:
            said = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())
            url = said.group(1) if said else ""
        if url:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    return Server(url, proc, log, token)
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"serve did not answer on {url}:\n{log.read_text()}")


def stop_serve(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(10)
    except subprocess.TimeoutExpired:
        server.proc.kill()


def wait_for(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
