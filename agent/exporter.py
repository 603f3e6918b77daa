"""Background exporter: drains the agent's queue and sends batches through a transport
(:class:`HttpTransport`: JSON to the collector, or through the node relay while it
answers; or ``otlp.OtlpTransport``). Steps are encoded here, off the training thread
(``report.StepEncoder``); a heartbeat goes out whenever nothing else has for
``heartbeat_s``, and the commands in the collector's answers go to :mod:`.commands`.

Modelled on OpenTelemetry's BatchProcessor: a daemon thread woken by a timer or an
``Event``, exports wrapped so nothing ever raises into the trainer, a ``flush(timeout)``
that waits on an ``Event`` the thread sets once what was queued has gone out (or into
the spool), and a ``shutdown(timeout)`` that flushes what it can before its deadline.

A batch the collector cannot take for now (unreachable, a retryable status such as 429
or 503, or a refused token) goes to the spool (:mod:`.spool`: on disk, bounded,
surviving the process), and so does every newer batch while anything waits there; the
oldest is resent after a jittered backoff or the collector's Retry-After, then the rest
in order. The in-memory queue is drained into the spool meanwhile, so the training
thread never waits and never fills it. A batch refused for good (another error status,
e.g. 422) is dropped and counted. At shutdown with the collector away, what is left
goes to the disk spool for the next process to send. Paths, headers and the JSON
encoding are the wire contract's (:mod:`.wire`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from .spool import Batch, MemorySpool, Spool, count
from .stats import Stats

# INGEST_PATH, SENDER_HEADER, sender, CollectorError, RETRYABLE and AUTH_REFUSED are also
# read from this module by the collector's tests and tests/e2e: they stay importable here.
from .wire import (
    AUTH_REFUSED,
    INGEST_PATH,
    RANK_TAKEN,
    RELAY_HEALTH_PATH,
    RETRYABLE,
    SENDER_HEADER,
    USER_AGENT,
    CollectorError,
    dumps,
    loads,
    sender,
)

log = logging.getLogger(__name__)

# A record whose device copy has not completed after this long is sent without it.
_MAX_PENDING_S = 10.0
# The exporter is Python and holds the GIL while it encodes; it lets go every few
# records so that a training thread waiting for the GIL gets it within microseconds
# instead of after CPython's 5 ms switch interval.
_YIELD_EVERY = 8
# While a flush waits for records whose device copy is in flight, the thread looks again
# this often instead of at its next tick.
_FLUSH_POLL_S = 0.02


class Transport(Protocol):
    """Sends one JSON body; returns the collector's JSON reply or raises."""

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


RELAY_RETRY_S = 30.0  # a relay found down is tried again after this long, ...
RELAY_FIRST_RETRY_S = 2.0  # ... or this, if never seen yet (local rank 0 may be starting it)


KEEPALIVE_S = 15.0
"""How long the agent keeps an idle connection to the collector or its relay (httpx's
default is 5 s): longer than the ``Retry-After`` a refused request waits (5 s), so that
the request sent again goes on the open connection instead of a new one to a collector
that is busy, and shorter than ``trainwarden serve``'s own idle timeout (20 s), so that
the agent, not the server, closes an idle connection (never one it is sending on)."""


class HttpTransport:
    """The real transport: one keep-alive httpx client. With ``relays`` (where the node
    relay may listen: one URL, or ``relay="auto"``'s candidates, of which the one that
    names ``job`` and this agent's collector is taken) batches go there, and straight to
    ``url`` while no relay can be reached (tried again every ``RELAY_RETRY_S``)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        timeout_s: float,
        relay: str | None = None,
        relays: list[str] | None = None,
        job: str | None = None,
    ) -> None:
        import httpx  # imported here so that `import trainwarden.agent` stays light

        self._httpx = httpx
        headers = {"User-Agent": USER_AGENT}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_S)
        self._client = httpx.Client(base_url=url, headers=headers, timeout=timeout_s, limits=limits)
        candidates = relays if relays is not None else ([relay] if relay is not None else [])
        self._candidates = [
            httpx.Client(base_url=u, headers=headers, timeout=timeout_s, limits=limits)
            for u in candidates
        ]
        self._relay = self._candidates[0] if len(self._candidates) == 1 else None
        self._job = job
        self._url = url.rstrip("/")
        self._relay_down_until = 0.0
        self._relay_checked = False
        self._relay_seen = False
        self.via_relay = 0  # requests the relay answered
        self.around_relay = 0  # ... and sent straight to the collector, the relay down

    @property
    def relay_url(self) -> str | None:
        """The relay this agent sends through (None: none found yet, or none asked for)."""
        return str(self._relay.base_url).rstrip("/") if self._relay is not None else None

    def _ask(self, client: Any) -> str | None:
        """Why the relay at ``client`` is not this agent's, or None when it is."""
        try:
            about = client.get(RELAY_HEALTH_PATH, timeout=2.0).json()
        except (self._httpx.HTTPError, ValueError) as exc:
            return f"no relay answers there ({exc})"
        upstream = about.get("upstream") if isinstance(about, dict) else None
        if upstream != self._url:
            return f"it sends to {upstream!r}, not to {self._url!r}"
        if self._job is not None and about.get("job") != self._job:
            return "it is another job's"
        return None

    def _relay_usable(self) -> bool:
        """Whether a relay is up and is a trainwarden relay sending to this agent's
        collector (a node may run jobs that send elsewhere), and, under ``auto``, this
        job's; asked once, and again each time it was found down."""
        if not self._candidates or time.monotonic() < self._relay_down_until:
            return False
        if self._relay_checked and self._relay is not None:
            return True
        why = "none"
        for client in self._candidates:
            why = self._ask(client) or ""
            if not why:
                self._relay = client
                self._relay_checked = self._relay_seen = True
                return True
        wait = RELAY_RETRY_S if self._relay_seen else RELAY_FIRST_RETRY_S
        self._relay_down_until = time.monotonic() + wait
        where = (
            str(self._candidates[0].base_url)
            if len(self._candidates) == 1
            else f"any of {len(self._candidates)} ports from "
            f"{self._candidates[0].base_url.port} on (the job's)"
        )
        misrouted = len(self._candidates) == 1 and why.startswith("it sends to")
        log.log(
            logging.WARNING if self._relay_seen or misrouted else logging.INFO,
            "trainwarden: not sending through the relay at %s: %s; sending to the "
            "collector directly for %.0f s",
            where,
            why,
            wait,
        )
        return False

    def _post(self, path: str, content: bytes, headers: dict[str, str]) -> Any:
        if self._relay_usable():
            assert self._relay is not None
            try:
                response = self._relay.post(path, content=content, headers=headers)
                self.via_relay += 1
                return response
            except (self._httpx.ConnectError, self._httpx.RemoteProtocolError) as exc:
                # Not there (or gone mid-answer): the collector, directly, for a while.
                # A replay of what the relay did send is deduplicated by the collector.
                self._relay_down_until = time.monotonic() + RELAY_RETRY_S
                self._relay_checked = False
                log.warning(
                    "trainwarden: relay unreachable (%s); sending to the collector "
                    "directly for %.0f s",
                    exc,
                    RELAY_RETRY_S,
                )
        if self._candidates:
            self.around_relay += 1
        return self._client.post(path, content=content, headers=headers)

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self._post(
            path,
            dumps(body),
            {"Content-Type": "application/json", SENDER_HEADER: sender(body)},
        )
        if response.status_code >= 400:
            retry_after = response.headers.get("Retry-After", "")
            wait = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else None
            # A conflict's body names the holder: kept whole, for the warning that quotes it.
            limit = 4000 if response.status_code == RANK_TAKEN else 500
            raise CollectorError(response.status_code, response.text[:limit], wait)
        return response.json() if response.content else {}

    def close(self) -> None:
        self._client.close()
        for client in self._candidates:
            client.close()


# A refused token (missing, revoked, or not allowed this run) is an operator's mistake
# that a restart with the right TRAINWARDEN_TOKEN fixes: keep the records (spool, bounded)
# and retry slowly, so that nothing is lost silently meanwhile.
AUTH_RETRY_S = 30.0
MAX_BACKOFF_S = 30.0


def flush_phase(node: str, interval_s: float) -> float:
    """Where in each ``interval_s`` a node's agents send, on the wall clock: the same for
    every rank of ``node`` (so its relay gets their batches together and sends them in
    one request), spread over the interval from node to node (so that the collector is
    not sent every node's request at the same instant)."""
    return zlib.crc32(node.encode()) % 100_000 / 100_000 * interval_s


class Exporter:
    """Owns the background thread. All public methods are safe from any thread.

    ``phase_of``: send on the wall clock's ticks, at the phase :func:`flush_phase` gives
    this name (with a relay: its node, or the relay's URL), not at a phase of the thread's
    own."""

    def __init__(
        self,
        *,
        queue: deque[Any],
        header: Callable[[], dict[str, Any]],
        encode: Callable[..., dict[str, Any] | None],
        transport: Transport,
        run: str,
        batch_size: int,
        interval_s: float,
        heartbeat_s: float,
        stats: Stats,
        on_commands: Callable[[Any], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        spool: Spool | None = None,
        phase_of: str | None = None,
    ) -> None:
        self._on_commands = on_commands
        self._on_tick = on_tick  # each wake-up, before sending (the Flight Recorder's stall check)
        self._poll = False  # send a heartbeat now: the trainer waits for a command
        # flush(): the callers' events, set once what was queued has gone out; and whether
        # this tick serves one (then it sends all that is queued, not one batch a tick).
        self._flushes: list[threading.Event] | None = []  # None once the thread has stopped
        self._flush_lock = threading.Lock()
        self._draining = False
        self._queue = queue
        self._header = header
        self._encode = encode
        self._transport = transport
        self._run = run
        self._batch_size = batch_size
        self._interval_s = min(interval_s, heartbeat_s)
        self._phase_s = None if phase_of is None else flush_phase(phase_of, self._interval_s)
        self._heartbeat_s = heartbeat_s
        self._last_sent = 0.0
        self._stats = stats
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._held: list[Any] = []  # records waiting for a device copy, in order
        self._failing = False
        # Batches the collector could not take for now (down, busy, 5xx), and every newer
        # one while any waits: resent oldest first after a jittered backoff or Retry-After.
        self._spool: Spool = (
            spool if spool is not None else MemorySpool(max_records=10_000, stats=stats)
        )
        self._retry_at = 0.0
        self._gave_up = False  # a send failed during shutdown: spool the rest
        # Another live process holds this rank (409): nothing more is sent for the run.
        self._rank_taken = False
        self._backoff = 0.5
        self._thread = threading.Thread(target=self._loop, name="trainwarden-exporter", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def poll_soon(self) -> None:
        self._poll = True
        self._wake.set()

    def flush(self, timeout_s: float) -> bool:
        """Wake the thread and wait (at most ``timeout_s``) until what is queued now has
        been sent, or spooled while the collector is away. False if the time ran out."""
        done = threading.Event()
        with self._flush_lock:
            if self._flushes is None:  # the thread has stopped: nothing will send it
                return False
            self._flushes.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def shutdown(self, timeout_s: float) -> None:
        """Send what is queued, within ``timeout_s``, then stop the thread."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "trainwarden: exporter did not finish within %.1fs; unsent records dropped",
                timeout_s,
            )
        self._transport.close()

    # -- the thread ---------------------------------------------------------------

    def _loop(self) -> None:
        flushes: list[threading.Event] = []  # flush() calls this thread is serving
        while True:
            # Wake for the next batch, or exactly when a heartbeat is due, whichever is first.
            beat_due = self._heartbeat_s - (time.monotonic() - self._last_sent)
            wait = self._interval_s
            if self._phase_s is not None:  # to the next tick (one just missed: the one after)
                wait -= (time.time() - self._phase_s) % self._interval_s
                wait += self._interval_s if wait < 0.005 else 0.0
            if flushes:  # a flush waits for records whose device copy is in flight
                wait = min(wait, _FLUSH_POLL_S)
            self._wake.wait(max(0.01, min(wait, beat_due)))
            self._wake.clear()
            stopping = self._stopping.is_set()
            with self._flush_lock:  # taken before the queue is read: they wait for all of it
                flushes += self._flushes or []
                self._flushes = []
            self._draining = bool(flushes)
            cpu = time.thread_time_ns()
            try:
                if self._on_tick is not None and not stopping:
                    self._on_tick()
                while self._export_once(final=stopping):
                    pass
                beat = self._poll or time.monotonic() - self._last_sent >= self._heartbeat_s
                if beat and not self._rank_taken:
                    self._poll = False
                    self._send([], [], [])  # nothing to send: a heartbeat alone
            except Exception:  # never let the thread die: the trainer must not notice
                log.exception("trainwarden: exporter error (records dropped)")
            self._stats.exporter_cpu_ns += time.thread_time_ns() - cpu
            if stopping:
                self._stop_spooling()
                with self._flush_lock:  # and a flush asked meanwhile: nothing will send it now
                    for done in flushes + (self._flushes or []):
                        done.set()
                    self._flushes = None
                return
            if not (self._queue or self._held):  # what the flushes waited for has gone out
                for done in flushes:
                    done.set()
                flushes = []

    def _take_batch(
        self, *, final: bool
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        steps: list[dict[str, Any]] = []
        events: list[dict[str, Any]] = []
        gpu: list[dict[str, Any]] = []
        now = time.monotonic()
        while self._queue and len(self._held) < self._batch_size:
            self._held.append(self._queue.popleft())  # deque.popleft is atomic
        keep: list[Any] = []
        for i, record in enumerate(self._held):
            if i % _YIELD_EVERY == _YIELD_EVERY - 1:
                time.sleep(0)  # release the GIL: see _YIELD_EVERY
            if len(steps) + len(events) + len(gpu) >= self._batch_size or keep:
                keep.append(record)  # preserve order behind a record still in flight
                continue
            if record.kind == "event":
                events.append(record.body)
                continue
            if record.kind == "gpu":
                gpu.append(record.body)
                continue
            waited = now - record.queued_at >= _MAX_PENDING_S
            body = self._encode(record, force=final or waited)
            if body is None:
                keep.append(record)  # a device copy is still in flight
                continue
            steps.append(body)
        self._held = keep
        return steps, events, gpu

    def _export_once(self, *, final: bool) -> bool:
        """Send one batch. Returns True when more is ready to send right away."""
        if self._rank_taken:
            self._drop_all()
            return False
        if len(self._spool):
            # At shutdown one more try, whatever the backoff says; after a failed one, no
            # more waiting on the network: the rest goes to the spool.
            if (time.monotonic() < self._retry_at and not final) or (final and self._gave_up):
                # The collector is away: what the trainer records goes behind what waits,
                # so the in-memory queue never fills.
                batch = self._take_batch(final=final)
                if not count(batch):
                    return False
                self._put(batch)
                return bool(self._queue)
            oldest = self._spool.oldest()
            if oldest is None:
                return False
            key, batch = oldest
            self._stats.retries += 1
            if self._send(*batch, final=final, spooled=True):
                self._spool.remove(key)
                self._stats.replayed += count(batch)
                return True
            return False
        steps, events, gpu = self._take_batch(final=final)
        if not steps and not events and not gpu:
            return False
        if not self._send(steps, events, gpu, final=final):
            return False  # wait for the next tick instead of spinning on a dead collector
        if final or self._draining:
            return bool(self._queue) or (bool(self._held) and final)
        # Records queued while this batch was out wait for the next tick, unless a whole
        # batch is ready: one request an interval (a relay holds each for its window, and
        # a fast trainer's next steps would otherwise go out behind it, again and again).
        return len(self._queue) >= self._batch_size

    def _drop_all(self) -> None:
        """Another process holds the rank: what is queued, held or spooled is dropped and
        counted (never kept: it would grow for the rest of the run)."""
        n = len(self._held)
        self._held = []
        for _ in range(len(self._queue)):  # what the training thread appends meanwhile: next time
            self._queue.popleft()
            n += 1
        while (oldest := self._spool.oldest()) is not None:
            n += count(oldest[1])
            self._spool.remove(oldest[0])
        self._stats.dropped_conflict += n

    def _rank_refused(self, exc: CollectorError, n: int) -> None:
        """The collector answered 409: another live process holds this run's rank. Say so
        once, and send nothing more for the run."""
        self._rank_taken = True
        self._stats.dropped_conflict += n
        try:
            detail = loads(exc.body.encode()).get("detail") or exc.body
        except (ValueError, AttributeError):
            detail = exc.body
        log.warning(
            "trainwarden: the collector refused this process's batches for run %r (409): "
            "%s. This process sends nothing more for the run: training goes on, and what "
            "it would have sent is dropped and counted in tw.stats()['dropped_conflict']",
            self._run,
            detail,
        )

    def _put(self, batch: Batch) -> None:
        try:
            self._spool.put(batch)
            self._stats.spooled += count(batch)
        except OSError as exc:  # a full or read-only disk: the records are lost, counted
            self._stats.dropped_spool_failed += count(batch)
            log.warning("trainwarden: cannot write to the spool (%s); records dropped", exc)

    def _stop_spooling(self) -> None:
        """At shutdown: what is still unsent goes to the spool; what only a memory spool
        holds is lost with the process and counted."""
        while self._queue or self._held:
            batch = self._take_batch(final=True)
            if not count(batch):
                break
            self._put(batch)
        if isinstance(self._spool, MemorySpool):
            left = 0
            while (oldest := self._spool.oldest()) is not None:
                left += count(oldest[1])
                self._spool.remove(oldest[0])
            self._stats.dropped_at_shutdown += left

    def _send(
        self,
        steps: list[dict[str, Any]],
        events: list[dict[str, Any]],
        gpu: list[dict[str, Any]],
        *,
        final: bool = False,
        spooled: bool = False,
    ) -> bool:
        body = {
            "run": self._run,
            "agent": self._header(),
            "steps": steps,
            "events": events,
            "gpu": gpu,
        }
        time.sleep(0)  # serializing a large body is GIL time too
        self._last_sent = time.monotonic()
        try:
            answer = self._transport.send(INGEST_PATH, body)
        except Exception as exc:
            self._stats.batches_failed += 1
            if isinstance(exc, CollectorError) and exc.status == RANK_TAKEN:
                self._rank_refused(exc, len(steps) + len(events) + len(gpu))
                if spooled and (key := self._spool.oldest()) is not None:
                    self._spool.remove(key[0])  # counted above
                return False
            refused = isinstance(exc, CollectorError) and exc.status in AUTH_REFUSED
            retryable = refused or not isinstance(exc, CollectorError) or exc.status in RETRYABLE
            n = len(steps) + len(events) + len(gpu)
            if refused:
                self._stats.batches_refused_auth += 1
            self._gave_up = final
            if retryable:
                # Keep it (the collector dedups a replay) and back off, honouring Retry-After.
                if n and not spooled:
                    self._put((steps, events, gpu))
                wait = getattr(exc, "retry_after", None) or self._backoff * random.uniform(0.5, 1.5)
                if refused:
                    wait = AUTH_RETRY_S * random.uniform(0.8, 1.2)
                self._retry_at = time.monotonic() + wait
                self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
            elif spooled:
                self._stats.dropped_send_failed += n
                key = self._spool.oldest()
                if key is not None:
                    self._spool.remove(key[0])  # refused as malformed: it never will be taken
            else:
                self._stats.dropped_send_failed += n
            if refused and not self._failing:
                log.error(
                    "trainwarden: the collector refused this agent's token (%s). Records are "
                    "kept in the spool (bounded) and resent every ~%.0f s; set TRAINWARDEN_TOKEN "
                    "(or tw.init(token=...)) to a token with the ingest scope for run %r and "
                    "restart",
                    exc,
                    AUTH_RETRY_S,
                    self._run,
                )
                self._failing = True
            elif not self._failing:
                what = "retrying with backoff" if retryable else "dropping what it refuses"
                log.warning("trainwarden: collector did not take a batch (%s); %s", exc, what)
                self._failing = True
            return False
        self._backoff = 0.5
        if self._on_commands is not None and isinstance(answer, dict) and answer.get("commands"):
            self._on_commands(answer["commands"])
        if self._failing:
            log.warning("trainwarden: collector reachable again")
            self._failing = False
        self._stats.sent += len(steps) + len(events) + len(gpu)
        self._stats.batches_sent += 1
        if not steps and not events and not gpu:
            self._stats.heartbeats += 1
        return True
