"""Tokens and scopes on a real database (SQLite and PostgreSQL): every API route is tried
without a token, with a token of the wrong scope, with a revoked one and with the right
one; ingest tokens limited to runs; secrets hashed at rest; the per-token rate limit;
the UI's login, its session, and its in-process writes (admin only)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select

from trainwarden.collector.api import auth
from trainwarden.collector.api.auth import AuthSettings
from trainwarden.collector.app import create_app
from trainwarden.collector.store import models
from trainwarden.collector.store.db import write
from trainwarden.collector.store.tokens import (
    Principal,
    TokenError,
    create_token,
    list_tokens,
    revoke_token,
    split_token,
)
from trainwarden.webui.client import LocalClient, Refused

from ..helpers import batch, step

INGEST = {"/api/v1/ingest", "/api/v1/ingest/columns", "/v1/metrics"}


def make_app(engine: Engine, **settings: Any) -> Any:
    settings.setdefault("cache_ttl_s", 0.0)  # a revocation counts at once in these tests
    return create_app(
        engine,
        ui=False,
        health=None,
        rollups=False,
        alerting=None,
        act=False,
        incidents=False,
        auth_settings=AuthSettings(**settings),
    )


def token(engine: Engine, name: str, *scopes: str, runs: str = "*") -> str:
    with write(engine) as conn:
        return create_token(conn, name=name, scopes=list(scopes), runs=runs, by="test")


def bearer(raw: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {raw}"}


@pytest.fixture
def tokens(engine: Engine) -> dict[str, str]:
    made = {
        name: token(engine, name, *scopes)
        for name, scopes in {
            "ingest": ["ingest"],
            "read": ["read"],
            "admin": ["admin"],
            "revoked": ["admin", "ingest"],
        }.items()
    }
    with write(engine) as conn:
        assert revoke_token(conn, name="revoked")
    return made


@pytest.fixture
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(make_app(engine)) as c:
        yield c


def routes(app: Any) -> list[tuple[str, str, str]]:
    """(method, path with its parameters filled in, scope it needs) of every API route,
    from the OpenAPI document: a route added later is tried too."""
    out = []
    for template, operations in app.openapi()["paths"].items():
        if not template.startswith(("/api/", "/v1/")):
            continue
        path = re.sub(r"\{[a-z_]+\}", "1", template.replace("{run}", "r1"))
        for method in sorted(m.upper() for m in operations):
            scope = "ingest" if template in INGEST else "read" if method == "GET" else "admin"
            out.append((method, path, scope))
    return out


def test_every_api_route_refuses_a_missing_a_revoked_and_a_wrong_token_and_lets_the_right_one_in(
    engine: Engine, client: TestClient, tokens: dict[str, str]
) -> None:
    table = routes(make_app(engine))
    writes = [r for r in table if r[2] == "admin"]
    assert len(writes) >= 11  # acks, silences (2), actions (3), incidents (4), notes
    assert {p for _, p, s in table if s == "ingest"} == INGEST
    for method, path, scope in table:
        where = f"{method} {path}"
        none = client.request(method, path, json={})
        assert none.status_code == 401, where
        assert none.headers["www-authenticate"].startswith("Bearer"), where
        revoked = client.request(method, path, json={}, headers=bearer(tokens["revoked"]))
        assert revoked.status_code == 401, where
        assert 'error="invalid_token"' in revoked.headers["www-authenticate"], where
        mistyped = client.request(method, path, json={}, headers=bearer(tokens["admin"][:-1] + "x"))
        assert mistyped.status_code == 401, where
        wrong = {"ingest": ["read", "admin"], "read": ["ingest"], "admin": ["ingest", "read"]}
        for other in wrong[scope]:
            refused = client.request(method, path, json={}, headers=bearer(tokens[other]))
            assert refused.status_code == 403, f"{where} with {other}"
            assert scope in refused.json()["detail"], where
        right = "ingest" if scope == "ingest" else "admin" if scope == "admin" else "read"
        let_in = client.request(method, path, json={}, headers=bearer(tokens[right]))
        assert let_in.status_code not in (401, 403), f"{where}: {let_in.text}"
        if scope == "read":  # admin implies read
            assert client.request(
                method, path, headers=bearer(tokens["admin"])
            ).status_code not in (401, 403)


def test_the_right_scopes_do_the_work(client: TestClient, tokens: dict[str, str]) -> None:
    ingest, read, admin = (bearer(tokens[k]) for k in ("ingest", "read", "admin"))
    sent = client.post("/api/v1/ingest", json=batch("r1", steps=[step(0), step(1)]), headers=ingest)
    assert sent.status_code == 200, sent.text
    assert client.get("/api/v1/runs/r1", headers=read).json()["last_step"] == 1
    note = client.post("/api/v1/runs/r1/notes", json={"author": "ana", "text": "hi"}, headers=admin)
    assert note.status_code == 201, note.text
    silence = client.post(
        "/api/v1/silences",
        headers=admin,
        json={
            "matchers": [{"name": "run", "value": "r1"}],
            "duration_s": 60,
            "created_by": "ana",
            "comment": "maintenance",
        },
    )
    assert silence.status_code == 201, silence.text
    incident = client.post(
        "/api/v1/incidents", json={"run": "r1", "title": "t", "by": "ana"}, headers=admin
    )
    assert incident.status_code == 201, incident.text
    # Open stays open: liveness, Prometheus, runbooks, the API's description.
    for path in ("/healthz", "/metrics", "/runbooks", "/openapi.json"):
        assert client.get(path).status_code == 200, path


def test_the_audit_trail_names_the_token_a_change_was_made_with(
    engine: Engine, client: TestClient, tokens: dict[str, str]
) -> None:
    """A typed name alone cannot pass for someone else: acks, silences, actions, incidents
    and notes record it with the token the request really used."""
    admin = bearer(tokens["admin"])  # a token named "admin"
    assert (
        client.post(
            "/api/v1/ingest", json=batch("r1", steps=[step(0)]), headers=bearer(tokens["ingest"])
        ).status_code
        == 200
    )
    note = client.post("/api/v1/runs/r1/notes", json={"author": "ana", "text": "hi"}, headers=admin)
    assert note.json()["author"] == "ana (as token admin)"
    silence = client.post(
        "/api/v1/silences",
        headers=admin,
        json={
            "matchers": [{"name": "run", "value": "r1"}],
            "duration_s": 60,
            "created_by": "ana",
            "comment": "maintenance",
        },
    )
    assert silence.json()["created_by"] == "ana (as token admin)"
    same = client.post(
        "/api/v1/incidents", json={"run": "r1", "title": "t", "by": "admin"}, headers=admin
    )
    assert same.status_code == 201, same.text
    with engine.connect() as conn:
        opened_by = conn.execute(select(models.incidents.c.opened_by)).scalars().all()
    assert opened_by == ["admin"]  # the token's own name: said once
    action = client.post(
        "/api/v1/runs/r1/actions",
        headers=admin,
        json={"kind": "rollback", "by": "b" * 128, "reason": "test", "dry_run": True},
    )
    assert action.status_code == 201, action.text
    trigger = action.json()["trigger"]
    assert trigger.startswith("operator:bbb") and trigger.endswith(" (as token admin)")
    assert len(trigger) <= 128  # the column's width


def test_an_ingest_token_sends_only_the_runs_its_pattern_matches(
    engine: Engine, client: TestClient
) -> None:
    llama = bearer(token(engine, "llama-agents", "ingest", runs="llama-*"))
    assert (
        client.post(
            "/api/v1/ingest", json=batch("llama-7b", steps=[step(0)]), headers=llama
        ).status_code
        == 200
    )
    other = client.post("/api/v1/ingest", json=batch("gpt-1", steps=[step(0)]), headers=llama)
    assert other.status_code == 403
    assert "'gpt-1'" in other.json()["detail"] and "llama-*" in other.json()["detail"]
    # A well-formed columnar body (a relay's) for a run the pattern does not match: refused
    # by the token check itself, not as malformed.
    columns = {
        "run": "gpt-1",
        "world_size": 1,
        "agents": [batch("gpt-1")["agent"]],
        "steps": {"rank": [0], "step": [0], "ts": [1.7e9], "duration_s": [0.1]},
    }
    refused = client.post("/api/v1/ingest/columns", json=columns, headers=llama)
    assert refused.status_code == 403, refused.text
    assert "'gpt-1'" in refused.json()["detail"] and "llama-*" in refused.json()["detail"]
    allowed = client.post(
        "/api/v1/ingest/columns", json={**columns, "run": "llama-13b"}, headers=llama
    )
    assert allowed.status_code == 200, allowed.text  # the same body is valid
    # OTLP/HTTP, the same token: refused for gpt-1, with nothing stored.
    from ..otlp_scenario import PROTOBUF, steps_request

    otlp = client.post(
        "/v1/metrics",
        content=steps_request(0, [1.0], run="gpt-1").SerializeToString(),
        headers={**PROTOBUF, **llama},
    )
    assert otlp.status_code == 403, otlp.text
    with engine.connect() as conn:
        names = sorted(r.name for r in conn.execute(select(models.runs.c.name)))
        rows = conn.execute(select(models.rank_steps.c.run_id)).all()
    assert names == ["llama-13b", "llama-7b"]
    assert len(rows) == 2  # llama-7b's step and llama-13b's: none of gpt-1


def test_the_database_keeps_no_secret(engine: Engine) -> None:
    raw = token(engine, "ops", "admin")
    _, secret = split_token(raw) or ("", "")
    assert len(secret) >= 43  # 256 random bits
    with engine.connect() as conn:
        stored = " ".join(
            str(tuple(row))
            for table in models.metadata.sorted_tables
            for row in conn.execute(select(table))
        )
        assert secret not in stored and raw not in stored
        (listed,) = list_tokens(conn)
    assert listed["name"] == "ops" and listed["scopes"] == ["admin"] and "secret_hash" not in listed


def test_token_requests_are_checked(engine: Engine) -> None:
    token(engine, "ops", "admin")
    with write(engine) as conn, pytest.raises(TokenError, match="exists"):
        create_token(conn, name="ops", scopes=["admin"], by="t")
    with write(engine) as conn, pytest.raises(TokenError, match="ingest, read, admin"):
        create_token(conn, name="x", scopes=["write"], by="t")
    with write(engine) as conn, pytest.raises(TokenError, match="token name"):
        create_token(conn, name="has space", scopes=["read"], by="t")


def test_a_token_over_its_rate_gets_429_with_retry_after(engine: Engine) -> None:
    raw = token(engine, "busy", "read")
    quiet = token(engine, "quiet", "read")
    with TestClient(make_app(engine, rate_per_s=0.5, burst=3)) as client:
        answers = [client.get("/api/v1/runs", headers=bearer(raw)) for _ in range(4)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]
        assert int(answers[-1].headers["retry-after"]) >= 1
        assert "busy" in answers[-1].json()["detail"]
        assert client.get("/api/v1/runs", headers=bearer(quiet)).status_code == 200  # per token


def test_a_revocation_counts_within_the_cache_time(engine: Engine) -> None:
    raw = token(engine, "ops", "read")
    with TestClient(make_app(engine, cache_ttl_s=3600)) as client:
        assert client.get("/api/v1/runs", headers=bearer(raw)).status_code == 200
        with write(engine) as conn:
            revoke_token(conn, name="ops")
        # Cached for an hour here: still let in. (serve's default is 5 s; see test_token_cli.)
        assert client.get("/api/v1/runs", headers=bearer(raw)).status_code == 200
    with TestClient(make_app(engine, cache_ttl_s=0)) as client:
        assert client.get("/api/v1/runs", headers=bearer(raw)).status_code == 401


def test_last_use_is_recorded_without_a_write_per_request(engine: Engine) -> None:
    raw = token(engine, "ops", "read")
    with TestClient(make_app(engine, cache_ttl_s=0, last_used_every_s=3600)) as client:
        for _ in range(5):
            assert client.get("/api/v1/runs", headers=bearer(raw)).status_code == 200
    with engine.connect() as conn:
        (row,) = list_tokens(conn)
    assert row["last_used_at"] is not None


# -- the web UI ---------------------------------------------------------------------------------


@pytest.fixture
def ui_app(engine: Engine) -> Any:
    app = create_app(
        engine,
        health=None,
        rollups=False,
        alerting=None,
        act=False,
        incidents=False,
        auth_settings=AuthSettings(
            cache_ttl_s=0, trusted_user_header="X-Forwarded-User", trusted_user_scope="read"
        ),
    )
    client = LocalClient(engine)

    def silence() -> str:  # what the UI's silence button does, inside the Dash server
        try:
            made = client.silence(
                matchers=[{"name": "run", "value": "r1"}],
                duration_s=60,
                by="ana",
                comment="maintenance",
            )
        except Refused as exc:
            return f"refused: {exc}"
        return f"silenced #{made.id}"

    app.state.dash.server.add_url_rule("/_test-silence", view_func=silence, methods=["POST"])
    return app


def test_the_ui_asks_for_a_login_and_a_read_session_views_but_cannot_change(
    engine: Engine, ui_app: Any, tokens: dict[str, str]
) -> None:
    with TestClient(ui_app, follow_redirects=False) as client:
        page = client.get("/runs/r1?x=1")
        assert page.status_code == 303
        assert page.headers["location"] == "/login?next=%2Fruns%2Fr1%3Fx%3D1"
        assert client.post("/_test-silence").status_code == 401
        assert "Log in" in client.get("/login").text
        # An ingest token cannot log in; a wrong one neither; an open redirect is not followed.
        assert client.post("/login", data={"token": tokens["ingest"]}).status_code == 403
        assert client.post("/login", data={"token": "tw_nope"}).status_code == 401
        made = client.post("/login", data={"token": tokens["read"], "next": "//evil.example"})
        assert made.status_code == 303 and made.headers["location"] == "/"
        assert "httponly" in made.headers["set-cookie"].lower()
        assert client.get("/").status_code == 200
        assert client.get("/api/v1/runs").status_code == 200  # the browser may follow API links
        assert client.post("/api/v1/silences", json={}).status_code == 401  # but not write there
        assert client.post("/_test-silence").text.startswith("refused: 'read' (read) may view")
        client.get("/logout")
        assert client.get("/").status_code == 303


def test_an_admin_session_changes_and_a_revoked_token_ends_its_session(
    engine: Engine, ui_app: Any, tokens: dict[str, str]
) -> None:
    with TestClient(ui_app, follow_redirects=False) as client:
        made = client.get("/login", params={"token": tokens["admin"], "next": "/alerts"})
        assert made.status_code == 303 and made.headers["location"] == "/alerts"
        assert client.post("/_test-silence").text.startswith("silenced #")
        with engine.connect() as conn:  # the UI's typed name, and the session's token
            by = conn.execute(select(models.silences.c.created_by)).scalar_one()
        assert by == "ana (as token admin)"
        with write(engine) as conn:
            revoke_token(conn, name="admin")
        assert client.get("/").status_code == 303
        forged = client.cookies.get(auth.SESSION_COOKIE, "")[:-1] + "0"
        client.cookies.set(auth.SESSION_COOKIE, forged)
        assert client.get("/").status_code == 303


def test_the_trusted_proxy_header_names_the_ui_user(ui_app: Any) -> None:
    with TestClient(ui_app, follow_redirects=False) as client:
        proxied = {"X-Forwarded-User": "alice@example.com"}
        assert client.get("/", headers=proxied).status_code == 200
        assert client.post("/_test-silence", headers=proxied).text.startswith(
            "refused: 'alice@example.com' (read)"
        )
        assert client.get("/api/v1/runs", headers=proxied).status_code == 401  # the API: tokens


def test_outside_a_request_the_check_lets_tests_and_tools_through() -> None:
    auth.check_admin()  # no principal: no auth configured (create_app without auth)
    reset = auth.current.set(Principal("viewer", frozenset({"read"})))
    try:
        with pytest.raises(Exception, match="may view, not change"):
            auth.check_admin()
    finally:
        auth.current.reset(reset)


def test_tokens_that_cannot_be_checked_get_503_not_a_crash(engine: Engine) -> None:
    raw = token(engine, "ops", "read")
    with TestClient(make_app(engine)) as client:
        models.tokens.drop(engine)  # the database cannot answer for tokens
        try:
            answer = client.get("/api/v1/runs", headers=bearer(raw))
            assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
        finally:
            models.tokens.create(engine)


def test_a_refused_request_vouches_only_for_the_runs_its_token_may_send() -> None:
    from trainwarden.collector.store.tokens import Principal

    token = auth.current.set(Principal("ci", frozenset({"ingest"}), runs="team-a-*"))
    try:
        assert auth.vouched("team-a-1/0-7") == "team-a-1/0-7"
        assert auth.vouched("team-b-1/0-7") is None  # cannot keep another run's ranks alive
        assert auth.vouched(None) is None
    finally:
        auth.current.reset(token)
    assert auth.vouched("team-b-1/3") == "team-b-1/3"  # auth off: as sent
