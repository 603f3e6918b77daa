"""Alembic environment and versions for trainwarden's schema (run by ``trainwarden db upgrade``)."""
