"""The alert engine inside ``serve``: evaluates the rules, keeps each alert's lifecycle
in the database, applies silences and inhibition, and hands notifications to the
notifiers.

One pass (every ``interval_s``, and at once when ingest stores an event or a flagged
step, so that an XID pages within a second):

1. For every live run (and every run with an open alert), fetch a
   :class:`~trainwarden.alerts.snapshot.Snapshot` with the windows the rules need and
   evaluate each rule on it (``alerts/evaluate.py``).
2. Advance each alert (rule + labels = fingerprint) through inactive → pending →
   firing → resolved (``alerts/lifecycle.py``) and write the changes: one row per
   episode in ``alerts``. A pending episode that clears is deleted.
3. Silences (``silences``) and inhibition decide what may page:
   - an alert whose rule has ``action: evict`` (FatalXid, EccUncorrectable: the node
     is going away) inhibits every other alert on the same node of the run;
   - a firing liveness alert (``category: liveness``: RankDead, RankHung) inhibits
     the other alerts of its rank (a dead rank is not also a straggler).
4. Notify: a firing alert that is neither silenced nor inhibited is sent once when it
   fires, again every ``resend_s`` until acknowledged, and once more when it resolves.

The state lives in the database, so it survives a restart, and on PostgreSQL one
collector at a time runs the pass (an advisory lock), as for the health evaluator.

What a pass reads is in ``snapshot.py``, how each alert steps through its lifecycle in
``advancing.py``, silences, inhibition, storms and notifications in ``routing.py``, what
it writes in ``writes.py``, storms and silence matching in ``trainwarden.alerts`` (pure),
the notifiers in ``notify/``. :class:`AlertEngine` keeps one pass's state (its caches of
settled steps, due rules, silent runs and deliveries) and runs the pass: reading it top
to bottom is reading a pass.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, or_, select

from trainwarden.alerts import Rule, fingerprint
from trainwarden.alerts.evaluate import evaluate
from trainwarden.alerts.rules import (
    AbsenceRule,
    BaselineRule,
    EventRule,
    JobLostMatch,
    RateRule,
    ThresholdRule,
)
from trainwarden.alerts.snapshot import Snapshot, Verdict
from trainwarden.collector.alerting.advancing import advance_active, advance_stored
from trainwarden.collector.alerting.routing import OPEN, route
from trainwarden.collector.alerting.snapshot import (
    Needs,
    SettledSteps,
    cadence_of,
    needs_of,
    snapshot,
)
from trainwarden.collector.alerting.writes import Writes, healed_alerts, store_deliveries
from trainwarden.collector.ingest.limits import Pressure
from trainwarden.collector.loops import spaced
from trainwarden.collector.read.economics import EconomicsSettings
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import leads, write

log = logging.getLogger(__name__)

ADVISORY_LOCK_KEY = 0x7477_616C_6572  # "twaler": one alert engine across collectors
FAST_KINDS = (EventRule, AbsenceRule, RateRule)
"""Rules a wake-up (ingest stored an event or a flagged step) evaluates at once."""


@dataclass(frozen=True)
class EngineSettings:
    interval_s: float = 2.0
    resend_s: float = 3600.0
    """Re-send a firing, unacknowledged alert this often (Alertmanager also needs it to
    keep the alert alive; see ``collector/alerting/notify/``)."""
    min_wake_s: float = 0.05
    """A burst of wake-ups runs one pass, not one each."""
    stale_run_s: float = 86400.0
    """A run silent this long is no longer evaluated (its open alerts resolve)."""
    group_over: int = 3
    """More notifications than this of one rule, run and status in one pass go out as one
    (a node's 8 ranks dying, a job that dies whole, or a collector cut off from it, is one
    page, not one a rank); the alerts themselves stay one a rank."""
    max_cpu_share: float = 0.25
    """A full pass may cost at most this share of one core (the engine thread's CPU):
    past that (16,384 ranks on a 2-core collector) passes are spaced out instead of
    taking time from ingest; ``trainwarden_alert_interval_seconds`` shows the interval."""
    refresh_s: float = 300.0
    """An open alert whose state is unchanged but whose value or description moved (a dead
    rank's silence grows on every pass) is written at most this often: a crashed run of
    16,384 ranks is 16,384 firing RankDead alerts, and rewriting them all on every pass
    took a tenth of the collector's CPU (every 30 s still left PostgreSQL 550 dead row
    versions a second to vacuum). A change of state, step or GPU is written at once."""
    silent_run_s: float = 60.0
    """A running run none of whose ranks has been heard from for this long (a crashed job:
    its RankDead alerts fired a minute ago) is evaluated every ``silent_every_s`` instead
    of on every pass, and its open alerts are neither read nor routed between (a new
    silence or a due resend reaches them up to ``silent_every_s`` late): with nothing new
    to read only the clock moves, and a dead run of 16,384 ranks evaluated every 2 s took
    a quarter of the collector's CPU from the runs still sending."""
    silent_every_s: float = 30.0
    ended_watch_s: float = 60.0
    """A run that ended (every rank said goodbye) is still evaluated this long by the rules
    that judge how a job ends (``match: job_lost``): a hung job torn down by its launcher
    says goodbye from every rank within a second, and its page is written from those
    goodbyes."""
    slow_rule_s: float = 15.0
    """At most this long between evaluations of a rank-scoped threshold or baseline rule
    that must hold for minutes: one reads every rank's rows of its window (a 20-step
    window at 8,192 ranks is 164,000 rows), and its ``for`` is not the time to within a
    pass. Evaluated every ``for``/20, at least every ``interval_s``."""

    @property
    def hold_s(self) -> float:
        return max(10.0, 3 * self.interval_s)


# -- the engine ---------------------------------------------------------------------


Submit = Callable[[Any], object]
"""Hands one ``trainwarden.alerts.Notification`` to the notifiers."""


@dataclass
class PassResult:
    runs: int = 0
    changed: int = 0
    notified: int = 0
    seconds: float = 0.0


def _judges_end(rule: Rule) -> bool:
    return isinstance(rule, EventRule) and isinstance(rule.params, JobLostMatch)


def _labels(rule: Rule, run: str, verdict: Verdict) -> dict[str, str]:
    labels = {"run": run}
    if verdict.rank is not None:
        labels["rank"] = str(verdict.rank)
    return {**rule.labels, **labels}


class AlertEngine:
    """Evaluates ``rules`` against ``engine``'s database; ``submit`` receives notifications."""

    def __init__(
        self,
        engine: Engine,
        rules: Sequence[Rule],
        *,
        settings: EngineSettings | None = None,
        external_url: str | None = None,
        submit: Submit | None = None,
        lag: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.time,
        metrics: Any = None,
        pressure: Pressure | None = None,
    ) -> None:
        self.engine = engine
        self.rules = {r.name: r for r in rules}
        self.settings = settings or EngineSettings()
        self.external_url = external_url
        self.submit = submit
        self.lag = lag
        self.pressure = pressure  # whether the collector fell behind, whom it refused
        self.clock = clock
        self.metrics = metrics  # prom.CollectorMetrics: pass durations, notifications
        self.spacing_s = self.settings.interval_s  # between full passes (max_cpu_share)
        if metrics is not None:
            metrics.alert_interval_seconds.set(self.spacing_s)
        self.needs = needs_of(rules, self.settings.hold_s)
        self.fast_needs = needs_of(
            [r for r in rules if isinstance(r, FAST_KINDS)], self.settings.hold_s
        )
        self._first_steps: dict[int, int] = {}
        self._due_needs: dict[tuple[str, ...], Needs] = {}
        self._settled: dict[int, SettledSteps] = {}
        self._evaluated_at: dict[str, float] = {}  # a slow rule's last evaluation
        self._silent_at: dict[int, float] = {}  # a silent run's last evaluation
        self.economics = EconomicsSettings()  # serve's price and MTBF (app.py sets them)
        self._cadence: dict[int, tuple[float, dict[str, Any]]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.deliveries: deque[Any] = deque(maxlen=100_000)  # attempts waiting to be stored

    # -- the thread ---------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainwarden-alerts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)

    def wake(self) -> None:
        """Evaluate the event, absence and rate rules now (ingest stored something notable)."""
        self._wake.set()

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            woken = self._wake.wait(max(0.0, due - time.monotonic()))
            if self._stop.is_set():
                return
            started, cpu = time.monotonic(), time.thread_time()
            full = started >= due
            if full:
                due = started + self.settings.interval_s
            self._wake.clear()
            try:
                self.run_once(fast_only=woken and not full)
            except Exception:
                log.exception("alert evaluation failed; retrying")
            if full:  # a full pass over its CPU share spaces the next one out
                spent = time.thread_time() - cpu
                self.spacing_s = spaced(
                    self.settings.interval_s, spent, self.settings.max_cpu_share
                )
                due = max(due, started + self.spacing_s)
                if self.metrics is not None:
                    self.metrics.alert_interval_seconds.set(self.spacing_s)
            self._stop.wait(self.settings.min_wake_s)

    def period_s(self, rule: Rule) -> float:
        """How often ``rule`` is evaluated: every pass, or (a rank-scoped threshold or
        baseline rule whose ``for`` is in seconds) every ``for``/20 up to ``slow_rule_s``."""
        interval = self.settings.interval_s
        if not isinstance(rule, (ThresholdRule, BaselineRule)) or rule.params.scope != "rank":
            return interval
        if rule.for_.unit != "s":
            return interval
        return max(interval, min(self.settings.slow_rule_s, rule.for_.value / 20))

    def _needs_of_due(self, rules: list[Rule]) -> Needs:
        """What this pass's rules need: a slow rule's window (DataLoaderStall's 20 steps
        of every rank) is read only on the passes that evaluate it. The columns stay
        those of all rules, so the settled steps kept between passes stay usable.

        The rows of steps still arriving (not rolled up yet) are read only for a
        rank-scoped rule evaluated every pass: one evaluated every 15 s (a ``for`` of
        minutes) gains nothing from rows a few seconds fresher, and they are read again
        on every evaluation (once rolled up, a step is read once and kept). Past
        capacity, with many steps arriving at once, DataLoaderStall's read of them took
        1.4-1.9 s of PostgreSQL a call at 40,960 ranks (bench/results/ingest-cpu-2vcpu.txt)."""
        key = tuple(r.name for r in rules)
        needs = self._due_needs.get(key)
        if needs is None:
            needs = needs_of(rules, self.settings.hold_s)
            needs.step_cols = set(self.needs.step_cols) if needs.step_cols else set()
            needs.steps_arriving = needs.steps_arriving and any(
                self.period_s(r) <= self.settings.interval_s
                for r in rules
                if isinstance(r, (ThresholdRule, BaselineRule)) and r.params.scope == "rank"
            )
            self._due_needs[key] = needs
        return needs

    def _due(self, rule: Rule, now: float) -> bool:
        period = self.period_s(rule)
        if period <= self.settings.interval_s:
            return True
        last = self._evaluated_at.get(rule.name)
        if last is not None and last <= now < last + period:
            return False
        self._evaluated_at[rule.name] = now
        return True

    # -- one pass -------------------------------------------------------------------

    def run_once(self, *, now: float | None = None, fast_only: bool = False) -> PassResult:
        """One pass in one transaction; on PostgreSQL only one collector runs it."""
        started = time.perf_counter()
        now = self.clock() if now is None else now
        notes: list[Any] = []
        with write(self.engine) as conn:
            if not leads(conn, ADVISORY_LOCK_KEY):
                return PassResult()
            store_deliveries(conn, self.deliveries)
            result = self._pass(conn, now, fast_only, notes)
        for note in notes:  # after the commit: what was paged is on record first
            self._send(note)
        result.seconds = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.alert_pass_seconds.observe(result.seconds)
            for note in notes:
                self.metrics.alert_notifications.labels(note.status).inc()
        return result

    def _pass(self, conn: Connection, now: float, fast_only: bool, notes: list[Any]) -> PassResult:
        result = PassResult()
        rules = [r for r in self.rules.values() if not fast_only or isinstance(r, FAST_KINDS)]
        rules = [r for r in rules if self._due(r, now)]
        needs = self.fast_needs if fast_only else self._needs_of_due(rules)
        a = m.alerts.c
        ru = m.runs.c
        runs = conn.execute(
            select(ru.id, ru.name, ru.created_at, ru.last_step, ru.status, ru.updated_at).where(
                or_(
                    (ru.status == "running") & (ru.updated_at > now - self.settings.stale_run_s),
                    ru.updated_at > now - self.settings.ended_watch_s,
                    ru.id.in_(select(a.run_id).where(a.state.in_(OPEN)).distinct()),
                )
            )
        ).all()
        ending = [r for r in rules if _judges_end(r)]
        # A resting run's open alerts are neither read nor routed this pass: a dead job's
        # thousands of RankDead alerts cost a pass every silent_every_s, not every pass.
        resting = {run.id for run in runs if self._rests(run, now, fast_only)}
        query = select(m.alerts).where(a.state.in_(OPEN))
        if resting:
            query = query.where(a.run_id.not_in(resting))
        open_rows = {row.fingerprint: row for row in conn.execute(query)}
        lag = self.lag() if self.lag is not None else 0.0
        pressed = self.pressure is not None and self.pressure.pressed()
        evaluated = {r.name for r in rules}
        seen: dict[str, tuple[Rule, Verdict, dict[str, str], Any, Snapshot]] = {}
        watched = {run.id for run in runs if run.status == "running"}
        self._settled = {
            run_id: kept for run_id, kept in self._settled.items() if run_id in watched
        }
        for run in runs:
            if run.id in resting:
                continue
            result.runs += 1
            live = run.status == "running"
            # A run that ended moments ago: only how it ended is judged.
            ended = (
                not live
                and ending
                and now - (run.updated_at or 0.0) < (self.settings.ended_watch_s)
            )
            advice = functools.partial(
                cadence_of, conn, run, now=now, settings=self.economics, cache=self._cadence
            )
            heard = self.pressure.heard(run.name) if self.pressure is not None else None
            snap = (
                snapshot(
                    conn,
                    run,
                    needs,
                    now=now,
                    lag_s=lag,
                    hold_s=self.settings.hold_s,
                    first_steps=self._first_steps,
                    cadence=advice,
                    step_cache=self._settled,
                    pressed=pressed,
                    heard=heard,
                )
                if live or ended
                else Snapshot(run=run.name, now=now)
            )
            for rule in rules if live else ending if ended else ():
                try:
                    verdicts = evaluate(rule, snap)
                except Exception:
                    log.exception("rule %s failed on run %s", rule.name, run.name)
                    continue
                for v in verdicts:
                    labels = _labels(rule, run.name, v)
                    seen[fingerprint(rule.name, labels)] = (rule, v, labels, run, snap)
        run_steps = {run.id: run.last_step for run in runs}
        writes = Writes()
        healed = healed_alerts(
            conn, [row for fp, row in open_rows.items() if fp not in seen and row.state == "firing"]
        )
        # Alerts the pass speaks for: those found active, and the open ones whose rule
        # was evaluated (or no longer exists, or whose run is no longer watched).
        for fp, row in open_rows.items():
            if fp in seen:
                continue
            rule_ = self.rules.get(row.rule)
            if rule_ is not None and row.rule not in evaluated and row.run_id in run_steps:
                continue  # a fast pass: this rule waits for the next full one
            result.changed += advance_stored(
                writes, row, rule_, now, run_steps.get(row.run_id), healed=row.id in healed
            )
        for fp, (rule, v, labels, run, snap) in seen.items():
            result.changed += advance_active(
                writes,
                fp,
                open_rows.get(fp),
                rule,
                v,
                labels,
                run,
                snap,
                now,
                external_url=self.external_url,
                refresh_s=self.settings.refresh_s,
            )
        writes.flush(conn)
        result.notified = route(
            conn,
            now,
            notes,
            resting,
            resend_s=self.settings.resend_s,
            group_over=self.settings.group_over,
            external_url=self.external_url,
        )
        return result

    def _rests(self, run: Any, now: float, fast_only: bool) -> bool:
        """Whether ``run`` sits this pass out: silent for ``silent_run_s`` (none of its
        ranks heard from), and evaluated less than ``silent_every_s`` ago (a fast pass,
        woken by something a run sent, never evaluates a silent run)."""
        if run.status != "running" or now - (run.updated_at or now) < self.settings.silent_run_s:
            self._silent_at.pop(run.id, None)
            return False
        last = self._silent_at.get(run.id)
        if fast_only or (last is not None and now - last < self.settings.silent_every_s):
            return True
        self._silent_at[run.id] = now
        return False

    def _send(self, note: Any) -> None:
        if self.submit is None:
            return
        try:
            self.submit(note)
        except Exception:
            log.exception("could not hand alert %s to the notifiers", note.fingerprint)
