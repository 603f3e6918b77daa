"""Where batches wait while the collector cannot take them: a bounded FIFO.

The exporter puts a batch here when the collector is unreachable or busy (and, from
then on, every newer batch behind it, so that order is kept), and sends the oldest
back when the collector answers again; the collector deduplicates a replay (steps on
(run, rank, step), events on their id), so each record is stored once.

:class:`DiskSpool` keeps one file per batch in a directory (one per run and rank), so
what waits survives the process: a restarted rank, or the next ``tw.init`` of the
same run on the host, sends it first. Past ``max_bytes`` the oldest batches are
deleted and their records counted as ``dropped_spool_full``. :class:`MemorySpool` is
the same FIFO in memory, bounded by records (the agent's ``queue_size``), for when no
directory can be used. Both are used from the exporter thread only. A spool file holds
``{"steps", "events", "gpu"}`` in the wire's encoding (:func:`.wire.dumps`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections import deque
from pathlib import Path
from typing import Any, Protocol

from .stats import Stats
from .wire import dumps

log = logging.getLogger(__name__)

Batch = tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]
"""(steps, events, gpu samples) as the ingest body carries them."""

_FILE = re.compile(r"^(\d{16})\.json$")


def default_spool_dir() -> str:
    """Node-local and per user: ``$TMPDIR/trainwarden-spool-<uid>``."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"trainwarden-spool-{uid}")


def count(batch: Batch) -> int:
    return sum(map(len, batch))


class Spool(Protocol):
    def put(self, batch: Batch) -> None: ...

    def oldest(self) -> tuple[Any, Batch] | None:
        """The oldest batch and a key to :meth:`remove` it by; None when empty."""

    def remove(self, key: Any) -> None: ...

    def __len__(self) -> int:
        """Batches waiting."""


class MemorySpool:
    def __init__(self, *, max_records: int, stats: Stats) -> None:
        self._batches: deque[tuple[int, Batch]] = deque()
        self._records = 0
        self._max = max_records
        self._stats = stats
        self._seq = 0

    def put(self, batch: Batch) -> None:
        self._seq += 1
        self._batches.append((self._seq, batch))
        self._records += count(batch)
        while self._records > self._max and len(self._batches) > 1:
            _, dropped = self._batches.popleft()
            self._records -= count(dropped)
            self._stats.dropped_spool_full += count(dropped)

    def oldest(self) -> tuple[Any, Batch] | None:
        return self._batches[0] if self._batches else None

    def remove(self, key: Any) -> None:
        if self._batches and self._batches[0][0] == key:
            _, batch = self._batches.popleft()
            self._records -= count(batch)

    def __len__(self) -> int:
        return len(self._batches)


class DiskSpool:
    """One JSON file per batch, named by a sequence number; written to a temporary name
    and renamed, so a crash never leaves half a batch to replay."""

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int, stats: Stats) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._max = max_bytes
        self._stats = stats
        self._files: deque[tuple[int, int, int]] = deque()  # (seq, bytes, records), oldest first
        for path in sorted(self.directory.iterdir()):
            match = _FILE.match(path.name)
            if match is None:
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)  # a write the last process did not finish
                continue
            self._files.append((int(match.group(1)), path.stat().st_size, -1))  # records: unknown
        self._bytes = sum(size for _, size, _ in self._files)
        self._seq = self._files[-1][0] if self._files else 0
        if self._files:
            log.warning(
                "trainwarden: %d batches left in the spool %s by an earlier process; "
                "sending them first",
                len(self._files),
                self.directory,
            )
        self._stats.spooled_from_earlier += len(self._files)

    def _path(self, seq: int) -> Path:
        return self.directory / f"{seq:016d}.json"

    def put(self, batch: Batch) -> None:
        data = dumps({"steps": batch[0], "events": batch[1], "gpu": batch[2]})
        self._seq += 1
        tmp = self._path(self._seq).with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(self._path(self._seq))
        self._files.append((self._seq, len(data), count(batch)))
        self._bytes += len(data)
        while self._bytes > self._max and len(self._files) > 1:
            seq, size, records = self._files.popleft()
            if records < 0:
                records = count(self._read(seq) or ([], [], []))
            self._path(seq).unlink(missing_ok=True)
            self._bytes -= size
            self._stats.dropped_spool_full += records

    def _read(self, seq: int) -> Batch | None:
        try:
            body = json.loads(self._path(seq).read_bytes())
            return body["steps"], body["events"], body["gpu"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("trainwarden: unreadable spool file %s dropped: %s", self._path(seq), exc)
            return None

    def oldest(self) -> tuple[Any, Batch] | None:
        while self._files:
            seq = self._files[0][0]
            batch = self._read(seq)
            if batch is not None:
                return seq, batch
            self.remove(seq)
            self._stats.dropped_spool_unreadable += 1
        return None

    def remove(self, key: Any) -> None:
        if self._files and self._files[0][0] == key:
            _, size, _ = self._files.popleft()
            self._bytes -= size
            self._path(key).unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._files)

    @property
    def bytes(self) -> int:
        return self._bytes
