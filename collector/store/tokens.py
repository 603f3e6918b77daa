"""API tokens: their form, their scopes, and creating, listing and revoking them.

A token reads ``tw_<id>_<secret>``: ``id`` (8 characters) finds the row, ``secret``
(43 characters, 256 random bits) proves possession. The database keeps the sha256 of
the secret, never the secret: a copy of the database lets no one send or act.

Plain functions with keyword-only arguments, no FastAPI: ``trainwarden token`` and
the collector's authentication (``auth``) both use them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import secrets
import string
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, insert, select, update

from trainwarden.collector.store.db import write
from trainwarden.collector.store.token_tables import tokens

SCOPES = ("ingest", "read", "admin")
"""``ingest``: send records (for the runs its pattern matches). ``read``: the API's GETs
and the web UI. ``admin``: everything ``read`` may, plus acknowledgements, silences,
actions, incidents and notes. ``admin`` implies ``read``; ``ingest`` implies nothing."""

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
TOKEN_PATTERN = re.compile(r"^tw_([a-z0-9]{8})_([A-Za-z0-9_-]{32,128})$")
_ID_ALPHABET = string.ascii_lowercase + string.digits


class TokenError(ValueError):
    """A token request that cannot be done (bad name, unknown scope, name taken, ...)."""


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: a token, a UI session made with one, or a proxy's user."""

    name: str
    scopes: frozenset[str]
    runs: str = "*"  # the runs an ingest token may send (a glob)
    token_id: str | None = None  # None: a user named by the trusted proxy header
    via: str = "token"  # token | session | proxy

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or (scope == "read" and "admin" in self.scopes)

    def may_ingest(self, run: str) -> bool:
        return "ingest" in self.scopes and fnmatch.fnmatchcase(run, self.runs)

    def describe(self) -> str:
        return f"{self.name!r} ({', '.join(sorted(self.scopes))})"


def hash_secret(secret: str) -> str:
    # sha256, not bcrypt/argon2: those slow down guessing a low-entropy password; this
    # secret is 256 random bits, which no guessing reaches, and a fast hash keeps the
    # check of every ingest request (thousands a second) in microseconds.
    return hashlib.sha256(secret.encode()).hexdigest()


def split_token(raw: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed token, else None."""
    match = TOKEN_PATTERN.match(raw.strip())
    return (match.group(1), match.group(2)) if match else None


def principal_of(row: Any, *, via: str = "token") -> Principal:
    return Principal(
        name=row.name, scopes=frozenset(row.scopes), runs=row.runs, token_id=row.token_id, via=via
    )


def _check(name: str, scopes: list[str], runs: str) -> None:
    if not NAME_PATTERN.match(name):
        raise TokenError(
            f"token name {name!r}: use 1-64 letters, digits, '.', '_', '@' or '-', "
            "starting with a letter or digit"
        )
    unknown = sorted(set(scopes) - set(SCOPES))
    if not scopes or unknown:
        raise TokenError(
            f"scope {', '.join(unknown) or '(none)'}: give one or more of {', '.join(SCOPES)}"
        )
    if not runs or len(runs) > 128:
        raise TokenError("--runs: a glob of 1-128 characters, e.g. 'llama-*' or '*'")


def create_token(
    conn: Connection, *, name: str, scopes: list[str], runs: str = "*", by: str
) -> str:
    """Store a new token and return it: the only time its secret is seen."""
    _check(name, scopes, runs)
    if conn.execute(select(tokens.c.id).where(tokens.c.name == name)).first() is not None:
        raise TokenError(f"a token named {name!r} exists; revoke it or choose another name")
    token_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))
    secret = secrets.token_urlsafe(32)
    conn.execute(
        insert(tokens).values(
            token_id=token_id,
            name=name,
            secret_hash=hash_secret(secret),
            scopes=sorted(set(scopes), key=SCOPES.index),
            runs=runs,
            created_at=time.time(),
            created_by=by[:128],
        )
    )
    return f"tw_{token_id}_{secret}"


def list_tokens(conn: Connection, *, revoked: bool = True) -> list[dict[str, Any]]:
    """Every token without its secret (there is none to show), oldest first."""
    query = select(
        tokens.c.name,
        tokens.c.token_id,
        tokens.c.scopes,
        tokens.c.runs,
        tokens.c.created_at,
        tokens.c.created_by,
        tokens.c.revoked_at,
        tokens.c.last_used_at,
    ).order_by(tokens.c.id)
    if not revoked:
        query = query.where(tokens.c.revoked_at.is_(None))
    return [dict(row._mapping) for row in conn.execute(query)]


def revoke_token(conn: Connection, *, name: str) -> bool:
    """Revoke by name; False when no live token has that name. The row stays (audit)."""
    done = conn.execute(
        update(tokens)
        .where(tokens.c.name == name, tokens.c.revoked_at.is_(None))
        .values(revoked_at=time.time())
    )
    return bool(done.rowcount)


def replace_token(
    conn: Connection, *, name: str, scopes: list[str], runs: str = "*", by: str
) -> str:
    """A fresh token under ``name``, the old one gone (the demo's tokens, each start)."""
    conn.execute(tokens.delete().where(tokens.c.name == name))
    return create_token(conn, name=name, scopes=scopes, runs=runs, by=by)


def find(engine: Engine, token_id: str) -> Any:
    """The live row of a token id, or None (unknown or revoked)."""
    with engine.connect() as conn:
        return conn.execute(
            select(tokens).where(tokens.c.token_id == token_id, tokens.c.revoked_at.is_(None))
        ).first()


def touch(engine: Engine, *, last_used: dict[str, float]) -> None:
    """Write when tokens were last used (batched: called at most every so often)."""
    with write(engine) as conn:
        for token_id, at in last_used.items():
            conn.execute(
                update(tokens).where(tokens.c.token_id == token_id).values(last_used_at=at)
            )
