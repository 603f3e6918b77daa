"""The collector's domain errors: what a service refuses, and the HTTP status that says
why. Services raise them with a message for the person who asked; the API turns every
one into its answer in one place (``collector/api/errors.py``), and the web UI shows the
message.

- :class:`NotFound` (404): a run, alert, action, incident ... that does not exist.
- :class:`Conflict` (409): the object is in a state that does not allow the change.
- :class:`Invalid` (422): the input is wrong; ``loc`` names the field when one is at fault.
"""

from __future__ import annotations

from collections.abc import Sequence


class DomainError(Exception):
    """A refusal with a status code (400 unless a subclass says otherwise)."""

    status_code = 400


class NotFound(DomainError, LookupError):
    """The named run (or other object) does not exist."""

    status_code = 404


class Conflict(DomainError):
    """The object's state does not allow the change asked for."""

    status_code = 409


class Invalid(DomainError, ValueError):
    """The input is wrong. ``loc``: where, as a validation error names it, e.g.
    ``("query", "metric")``; the message then reads as that field's."""

    status_code = 422

    def __init__(self, message: str, *, loc: Sequence[str] | None = None) -> None:
        super().__init__(message)
        self.loc = tuple(loc) if loc else None
