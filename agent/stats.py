"""The agent's counters: what it recorded, sent and dropped, and why.

One :class:`Stats` per agent, shared by the record queue (:mod:`.sink`), the exporter
thread and the spool; ``tw.stats()`` returns it as a dict whose keys are the field names.
Each counter is written by one thread at a time in practice; a count lost to a race
between two threads is a count, not a record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class Stats:
    recorded: int = 0
    """Records (steps, events, GPU samples) the agent took."""
    dropped_queue_full: int = 0
    """Oldest records dropped because the in-memory queue was full."""
    sent: int = 0
    """Records the collector took."""
    batches_sent: int = 0
    """Requests the collector took (heartbeats included)."""
    batches_failed: int = 0
    """Requests that failed: unreachable, refused, or an error status."""
    batches_refused_auth: int = 0
    """Requests refused with 401/403 (a missing or wrong token); their records are kept."""
    dropped_send_failed: int = 0
    """Records the collector refused for good: an error status neither retryable (429, 500,
    502, 503, 504) nor an auth refusal (401, 403), e.g. 413 or 422."""
    exporter_cpu_ns: int = 0
    """CPU time of the exporter thread (encoding, sending), off the training thread."""
    heartbeats: int = 0
    """Requests that carried nothing but the heartbeat."""
    retries: int = 0
    """Sends of the spool's oldest batch after the collector could not take it."""
    dropped_at_shutdown: int = 0
    """Records still unsent at shutdown that only a memory spool held (lost with the process)."""
    spooled: int = 0
    """Records put in the spool while the collector was away."""
    replayed: int = 0
    """Records sent from the spool once the collector was back."""
    spooled_from_earlier: int = 0
    """Batches an earlier process of this run and rank left in the disk spool."""
    dropped_spool_full: int = 0
    """Records of the oldest spooled batches deleted past the spool's bound."""
    dropped_spool_failed: int = 0
    """Records lost because the spool could not be written (a full or read-only disk)."""
    dropped_spool_unreadable: int = 0
    """Spool files that could not be read back (damaged), deleted."""
    dropped_conflict: int = 0
    """Records dropped, not sent, once the collector refused this process's rank because
    another live process of the run holds it (409: a double launch)."""

    def as_dict(self) -> dict[str, int]:
        """The counters by name, in the order above (what ``tw.stats()`` returns)."""
        return asdict(self)

    def __getitem__(self, name: str) -> int:
        """``stats["sent"]``: the counter by its ``tw.stats()`` name, as before it was typed."""
        if name not in _NAMES:
            raise KeyError(name)
        value: int = getattr(self, name)
        return value


_NAMES = frozenset(f.name for f in fields(Stats))
