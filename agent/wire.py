"""The wire contract that the agent's exporter, the node relay, the spool and the collector
share: the ingest paths, the headers, the JSON encoding and what a refusal means.

One home for it, so that the exporter (which sends), the relay (which merges and forwards),
the spool (which keeps batches on disk in the same encoding) and the collector (which reads
``SENDER_HEADER`` and ``Via``, see ``collector/api/routes/ingest.py`` and
``collector/ingest/limits.py``) cannot drift apart. Standard library only: the relay runs
without torch or httpx; orjson is used when installed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

INGEST_PATH = "/api/v1/ingest"
"""One rank's batch: ``{run, agent, steps, events, gpu}`` (the collector's ``IngestBatch``)."""
COLUMNS_PATH = "/api/v1/ingest/columns"
"""Several ranks' batches of one run, steps column-wise: what a node relay sends."""
RELAY_HEALTH_PATH = "/relay/healthz"
"""The relay's own page: ``{status, upstream, ...its counters}``; agents check ``upstream``."""

USER_AGENT = "trainwarden-agent"
SENDER_HEADER = "X-Trainwarden-Sender"
"""``RUN/RANKS`` (``r1/3``, ``r1/0-7``): who sends, readable without the body. A request a
busy collector refuses (503) still counts as those ranks' heartbeat."""
RELAY_NAME = "trainwarden-relay"
RELAY_VIA = f"1.1 {RELAY_NAME}"
"""The ``Via`` header of a request the relay passes on as it came: the collector then does
not take it for a large run's rank that sends without a relay (and logs no hint)."""

RETRYABLE = frozenset({429, 500, 502, 503, 504})
"""Statuses that mean "not now": the batch is kept (spooled) and sent again after a backoff."""
RANK_TAKEN = 409
"""Another live process holds this run's rank (a double launch, ``RANK`` not set, two jobs
under one run name): nothing of the batch was stored, and the agent stops sending for
the run. The body names the holder: ``{detail, reason, run, rank, holder}``."""
AUTH_REFUSED = frozenset({401, 403})
"""A missing, revoked or wrong token: an operator's mistake that a restart with the right
``TRAINWARDEN_TOKEN`` fixes, so the batch is kept and retried slowly, never dropped."""


class CollectorError(RuntimeError):
    """The collector (or the relay, or an OpenTelemetry Collector) answered ``status``;
    ``retry_after``: its ``Retry-After`` in seconds, if it gave one."""

    def __init__(self, status: int, body: str, retry_after: float | None = None) -> None:
        super().__init__(f"collector answered {status}: {body}")
        self.status = status
        self.body = body
        self.retry_after = retry_after


def dumps(body: Any) -> bytes:
    """A body as JSON bytes. NaN and infinities are refused: the agent sends them as
    strings (``values.json_number``)."""
    try:
        import orjson  # several times faster than json: less GIL time taken from the trainer
    except ImportError:
        return json.dumps(body, allow_nan=False).encode()
    return orjson.dumps(body)


def loads(raw: bytes) -> Any:
    """JSON bytes as Python values; ``ValueError`` when they are not JSON."""
    try:
        import orjson
    except ImportError:
        return json.loads(raw)
    return orjson.loads(raw)


def sender(body: dict[str, Any]) -> str:
    """``RUN/RANK``: who sends ``body`` (the ``SENDER_HEADER`` of one rank's batch)."""
    agent = body.get("agent") or {}
    return f"{body.get('run', '')}/{agent.get('rank', '')}"


def ranks_header(run: str, ranks: Sequence[int]) -> str:
    """``RUN/0-7,12``: the ``SENDER_HEADER`` of a request for many ranks."""
    parts: list[str] = []
    ordered = sorted(set(ranks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return f"{run}/{','.join(parts)}"
