"""API tokens (``trainwarden token create``; checked and managed in ``tokens``)."""

from __future__ import annotations

from sqlalchemy import Column, Table
from sqlalchemy.types import JSON, Float, Integer, String

from trainwarden.collector.store.table_base import metadata

# API tokens (``trainwarden token create``). Only a hash of the secret is stored; the
# token itself is shown once, at creation. ``token_id`` is the public part of the token
# (``tw_<token_id>_<secret>``): the row is found by it, the secret is checked against
# ``secret_hash``.
tokens = Table(
    "tokens",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("token_id", String(16), nullable=False, unique=True),
    Column("name", String(64), nullable=False, unique=True),
    Column("secret_hash", String(64), nullable=False),  # sha256, hex
    Column("scopes", JSON, nullable=False),  # ["ingest"], ["read"], ["admin"], ...
    Column("runs", String(128), nullable=False),  # glob of the runs an ingest token may send
    Column("created_at", Float, nullable=False),
    Column("created_by", String(128), nullable=False),
    Column("revoked_at", Float),
    Column("last_used_at", Float),  # written at most once a minute per token
)
