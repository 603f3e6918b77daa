"""Shared fixtures: real PostgreSQL and SQLite, a real ``trainwarden serve``, a real browser.

PostgreSQL comes from ``TRAINWARDEN_TEST_DATABASE_URL``, else the server on
127.0.0.1:5432, else a throwaway cluster started with the local PostgreSQL binaries.
If none of these works the tests that need it ERROR with the reason: they never skip.
The same holds for Chromium. Only GPU tests may skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from trainwarden.collector.store.db import make_engine, upgrade

from .helpers import Server, database_url, new_database, start_serve, stop_serve
from .net import free_port

__all__ = ["free_port"]  # imported from here by many tests

DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
CHROMIUM = "/usr/bin/chromium"


def _pg_answers(url: str) -> str | None:
    """None if the server answers, else the reason."""
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
        return None
    except Exception as exc:
        return str(getattr(exc, "orig", exc)).strip().splitlines()[0]


def _run(cmd: list[str], **kwargs: object) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:2])} failed: {(result.stderr or result.stdout).strip()[-500:]}"
        )


def _throwaway_cluster() -> tuple[str, Callable[[], None]]:
    """Start a PostgreSQL cluster from the local binaries on a free port.

    As root, Debian's pg_createcluster runs it as the postgres user; as anyone else,
    initdb and pg_ctl run it as that user.
    """
    versions = (
        sorted(os.listdir("/usr/lib/postgresql")) if os.path.isdir("/usr/lib/postgresql") else []
    )
    bindir = Path(f"/usr/lib/postgresql/{versions[-1]}/bin") if versions else None
    port = free_port()
    datadir = tempfile.mkdtemp(prefix="tw-pg-")
    os.chmod(datadir, 0o755)  # the postgres user must be able to enter it
    if os.geteuid() == 0 and shutil.which("pg_createcluster") and versions:
        name = f"tw{os.getpid()}"
        _run(
            [
                "pg_createcluster",
                versions[-1],
                name,
                "--port",
                str(port),
                "--datadir",
                f"{datadir}/pg",
                "--",
                "--auth-local=trust",
                "--auth-host=trust",
            ]
        )
        _run(["pg_ctlcluster", versions[-1], name, "start"])

        def stop() -> None:
            subprocess.run(["pg_ctlcluster", versions[-1], name, "stop"], capture_output=True)
            subprocess.run(["pg_dropcluster", versions[-1], name], capture_output=True)
            shutil.rmtree(datadir, ignore_errors=True)

        return f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", stop
    initdb = bindir / "initdb" if bindir else Path(shutil.which("initdb") or "initdb")
    pg_ctl = initdb.with_name("pg_ctl")
    if not initdb.exists():
        raise RuntimeError("no PostgreSQL binaries found (install postgresql)")
    _run([str(initdb), "-D", f"{datadir}/pg", "-U", "postgres", "--auth=trust"])
    _run(
        [
            str(pg_ctl),
            "-D",
            f"{datadir}/pg",
            "-l",
            f"{datadir}/log",
            "-w",
            "-o",
            f"-p {port} -k {datadir} -c listen_addresses=127.0.0.1",
            "start",
        ]
    )

    def stop() -> None:
        subprocess.run(
            [str(pg_ctl), "-D", f"{datadir}/pg", "-m", "fast", "stop"], capture_output=True
        )
        shutil.rmtree(datadir, ignore_errors=True)

    return f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", stop


@pytest.fixture(autouse=True)
def _spool_per_test(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test's agents (and the processes it starts) spool in a folder of their own:
    a batch one test left behind must never be replayed into another."""
    monkeypatch.setenv("TRAINWARDEN_SPOOL_DIR", str(tmp_path_factory.mktemp("spool")))


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """URL of a PostgreSQL server the tests may create databases on."""
    url = os.environ.get("TRAINWARDEN_TEST_DATABASE_URL")
    stop = None
    if url:
        reason = _pg_answers(url)
        if reason:
            pytest.fail(
                f"POSTGRES MISSING: TRAINWARDEN_TEST_DATABASE_URL={url} does not answer: {reason}",
                pytrace=False,
            )
    else:
        url = DEFAULT_PG
        reason = _pg_answers(url)
        if reason:
            try:
                url, stop = _throwaway_cluster()
            except Exception as exc:
                pytest.fail(
                    f"POSTGRES MISSING: nothing answers at {DEFAULT_PG} ({reason}) and a throwaway "
                    f"cluster could not be started ({exc}). Set TRAINWARDEN_TEST_DATABASE_URL.",
                    pytrace=False,
                )
            deadline = time.monotonic() + 20
            while (reason := _pg_answers(url)) and time.monotonic() < deadline:
                time.sleep(0.2)
            if reason:
                pytest.fail(
                    f"POSTGRES MISSING: throwaway cluster does not answer: {reason}", pytrace=False
                )
    yield url
    if stop is not None:
        stop()


@pytest.fixture(scope="session")
def pg_url(pg_server: str) -> Iterator[str]:
    """A fresh database for this test session, at the latest schema."""
    with new_database(pg_server, "tw_test") as url:
        yield url


@pytest.fixture
def pg_alone_url(pg_server: str) -> Iterator[str]:
    """A database of this test's own, at the latest schema: for a test that measures what
    PostgreSQL does with its rows, which another connection to the same database (an
    earlier test's server still closing, its snapshot) would change."""
    with new_database(pg_server, "tw_alone") as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Each test using it runs once on SQLite and once on PostgreSQL, on empty tables
    (an end-to-end test names one: tests/e2e/conftest.py)."""
    yield from database_url(request, tmp_path)


@pytest.fixture(scope="session")
def sqlite_schema(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file at the latest schema, made once a session: a test's own database
    starts as a copy of it (33 migrations took 0.3 s a test, a copy 0.03 s)."""
    path = tmp_path_factory.mktemp("schema") / "tw.db"
    engine = make_engine(f"sqlite:///{path}")
    upgrade(engine)
    engine.dispose()
    return path


def _migrated(db_url: str, request: pytest.FixtureRequest) -> None:
    """An empty SQLite file of ``db_url`` made a copy of the migrated schema."""
    prefix = "sqlite:///"
    if db_url.startswith(prefix) and not Path(db_url[len(prefix) :]).exists():
        shutil.copyfile(request.getfixturevalue("sqlite_schema"), db_url[len(prefix) :])


@pytest.fixture
def engine(db_url: str, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    from trainwarden.collector.read import mixture

    _migrated(db_url, request)
    engine = make_engine(db_url)
    upgrade(engine)  # nothing to do on a copy; PostgreSQL's session database is migrated
    mixture.forget()  # declared mixtures are cached by run id; a fresh database reuses ids
    yield engine
    engine.dispose()


@pytest.fixture
def live_server(db_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    _migrated(db_url, request)
    server = start_serve(db_url, tmp_path / "serve.log")
    yield server
    stop_serve(server)


@pytest.fixture(scope="session")
def browser():  # type: ignore[no-untyped-def]
    if not os.path.exists(CHROMIUM):
        pytest.fail(
            f"BROWSER MISSING: {CHROMIUM} not found. "
            "Install it: apt-get install -y chromium chromium-driver",
            pytrace=False,
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield browser
        browser.close()
