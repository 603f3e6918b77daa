"""Delivering notifications in the background: ``Dispatcher.submit()`` only appends to
the receiver's bounded queue, from any thread: a receiver that is down or slow never
blocks the caller. Each receiver has its own worker task; deliveries of different alerts
run side by side (a hung request delays nobody else), those of one alert in order (a
resolve never overtakes its firing). A failed attempt is retried with jittered
exponential backoff while it can succeed (timeouts, connection errors, 408, 429, 5xx),
and every attempt is reported to ``on_attempt`` as an :class:`Attempt`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from trainwarden.alerts.notification import Notification

from .config import NotifyConfig
from .receivers import DeliveryError, Notifier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Attempt:
    """One delivery attempt of one notification to one receiver."""

    alert_id: int
    fingerprint: str
    status: str
    receiver: str
    kind: str
    attempt: int
    ok: bool
    http_status: int | None
    error: str | None
    at: float
    duration_s: float
    final: bool
    """No more attempts follow: delivered, or given up."""


# -- delivery -----------------------------------------------------------------------------

MAX_IN_FLIGHT = 32
"""Requests to one receiver at once (each to a different alert)."""


class _Lane:
    """One receiver's queue. ``inbox`` takes notifications from any thread; on the event
    loop each alert (fingerprint) gets a chain, delivered in order by its own task, so a
    hung request holds up only the later notifications of the same alert."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self.inbox: deque[Notification] = deque()  # append / popleft are thread-safe
        self.pending = 0  # accepted, not yet delivered or given up (under Dispatcher._lock)
        self.chains: dict[str, deque[Notification]] = {}  # fingerprint -> in flight, then next
        self.tasks: set[asyncio.Task[None]] = set()
        self.slots = asyncio.Semaphore(MAX_IN_FLIGHT)


class Dispatcher:
    """Delivers notifications to the receivers their routes name, in the background.

    ``submit()`` may be called from any thread, before or after ``start()``; deliveries
    run on the event loop ``start()`` is awaited in. ``on_attempt`` is called on that
    loop for every attempt: keep it cheap (append to a queue), it cannot break delivery.
    """

    def __init__(
        self,
        config: NotifyConfig,
        *,
        on_attempt: Callable[[Attempt], None] | None = None,
        max_attempts: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        timeout_s: float = 5.0,
        queue_size: int = 10_000,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1 (got {max_attempts})")
        if backoff_s < 0 or max_backoff_s < backoff_s:
            raise ValueError(
                f"need 0 <= backoff_s <= max_backoff_s (got {backoff_s}, {max_backoff_s})"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive (got {timeout_s})")
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1 (got {queue_size})")
        self.config = config
        self.on_attempt = on_attempt
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.queue_size = queue_size
        self.sent = 0  # notifications delivered (per receiver)
        self.failed = 0  # ... given up
        self.dropped = 0  # ... refused by a full queue, or left when stop() ran out of time
        self._lanes = {r.name: _Lane(r) for r in config.receivers.values()}
        self._lock = threading.Lock()  # pending counts and dropped; never held across I/O
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._client: httpx.AsyncClient | None = None
        self._stopped = False
        self._closing = asyncio.Event()  # stop(): no more retries, backoffs end now

    @property
    def stats(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "failed": self.failed,
            "dropped": self.dropped,
            "pending": {name: lane.pending for name, lane in self._lanes.items()},
        }

    async def start(self) -> None:
        """Start delivering, on the running event loop (what was submitted before too)."""
        if self._loop is not None:
            raise RuntimeError("this Dispatcher was already started")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._client = httpx.AsyncClient(
            timeout=self.timeout_s, headers={"User-Agent": "trainwarden-notify"}
        )
        self._pump(list(self._lanes.values()))

    def submit(self, n: Notification) -> bool:
        """Queue ``n`` for each receiver its routes name; never blocks, never raises.
        False when a receiver's queue was full (``n`` is dropped there and counted)."""
        try:
            lanes = [self._lanes[r.name] for r in self.config.receivers_for(n)]
            accepted = True
            with self._lock:
                for lane in lanes:
                    if self._stopped or lane.pending >= self.queue_size:
                        self.dropped += 1
                        accepted = False
                        continue
                    lane.pending += 1
                    lane.inbox.append(n)
                dropped = self.dropped
            if not accepted and (dropped == 1 or dropped % 1000 == 0):
                log.warning("notification queue full or stopped: %d notifications dropped", dropped)
            self._kick(lanes)
            return accepted
        except Exception:  # the engine must go on whatever happens here
            log.exception("could not queue the notification of alert %s", n.alert_id)
            return False

    def _kick(self, lanes: list[_Lane]) -> None:
        if self._loop is None or not lanes:
            return  # start() takes them
        if threading.get_ident() == self._loop_thread:
            self._pump(lanes)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._pump, lanes)

    def _pump(self, lanes: list[_Lane]) -> None:
        """On the loop: move each inbox into the chains; a new chain gets a task."""
        for lane in lanes:
            while lane.inbox:
                n = lane.inbox.popleft()
                chain = lane.chains.get(n.fingerprint)
                if chain is not None:
                    chain.append(n)  # after the one in flight: a resolve follows its firing
                    continue
                lane.chains[n.fingerprint] = deque([n])
                task = asyncio.create_task(self._run_chain(lane, n.fingerprint))
                lane.tasks.add(task)
                task.add_done_callback(lane.tasks.discard)

    async def _run_chain(self, lane: _Lane, fp: str) -> None:
        chain = lane.chains[fp]
        try:
            while chain:
                async with lane.slots:
                    await self._deliver(lane, chain[0], chain)
                chain.popleft()
                with self._lock:
                    lane.pending -= 1
        finally:
            del lane.chains[fp]

    async def _deliver(self, lane: _Lane, n: Notification, chain: deque[Notification]) -> None:
        notifier = lane.notifier
        assert self._client is not None
        for attempt in range(1, self.max_attempts + 1):
            at, started = time.time(), time.monotonic()
            http_status: int | None = None
            error: str | None = None
            retryable = False
            try:
                http_status = await asyncio.wait_for(notifier.send(n, self._client), self.timeout_s)
            except asyncio.TimeoutError:
                error, retryable = f"timed out after {self.timeout_s:g}s", True
            except DeliveryError as exc:
                error, http_status, retryable = exc.message, exc.http_status, exc.retryable
            except Exception as exc:  # a notifier's bug: say so, and try again
                log.warning("receiver %s raised", notifier.name, exc_info=True)
                error, retryable = f"{type(exc).__name__}: {exc}"[:200], True
            final = error is None or not retryable or attempt == self.max_attempts
            if not final and len(chain) > 1:
                final, error = (
                    True,
                    f"{error}; not retried: a newer notification of this alert follows",
                )
            elif not final and self._closing.is_set():
                final, error = True, f"{error}; not retried: shutting down"
            self._report(
                Attempt(
                    n.alert_id,
                    n.fingerprint,
                    n.status,
                    notifier.name,
                    notifier.kind,
                    attempt,
                    error is None,
                    http_status,
                    error,
                    at,
                    time.monotonic() - started,
                    final,
                )
            )
            if error is None:
                self.sent += 1
                return
            if final:
                self.failed += 1
                log.warning(
                    "gave up notifying %s of %s %s (alert %s) after %d attempts: %s",
                    notifier.name,
                    n.status,
                    n.alertname,
                    n.alert_id,
                    attempt,
                    error,
                )
                return
            await self._pause(attempt)

    async def _pause(self, attempt: int) -> None:
        """Exponential backoff with jitter (a fleet of alerts does not retry in step);
        stop() ends it early."""
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._closing.wait(), delay * random.uniform(0.5, 1.0))

    def _report(self, attempt: Attempt) -> None:
        if self.on_attempt is None:
            return
        try:
            self.on_attempt(attempt)
        except Exception:
            log.exception(
                "on_attempt failed for an attempt to %s; delivery goes on", attempt.receiver
            )

    def _pending(self) -> int:
        with self._lock:
            return sum(lane.pending for lane in self._lanes.values())

    async def drain(self, timeout_s: float) -> None:
        """Wait until everything submitted is delivered or given up, or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._pending() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def stop(self, deadline_s: float = 5.0) -> None:
        """Refuse new notifications, give what is queued one last try (no more backoff)
        until ``deadline_s``, then drop what is left (counted) and close."""
        with self._lock:
            self._stopped = True
        self._closing.set()
        if self._loop is not None:  # else nothing was ever sent: drop it all
            await self.drain(deadline_s)
        tasks = [task for lane in self._lanes.values() for task in lane.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with self._lock:
            left = sum(lane.pending for lane in self._lanes.values())
            for lane in self._lanes.values():
                lane.pending = 0
                lane.inbox.clear()
            self.dropped += left
        if left:
            log.warning("stopped with %d notifications undelivered (dropped)", left)
        if self._client is not None:
            await self._client.aclose()
