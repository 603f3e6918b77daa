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

What a pass reads is in ``snapshot.py``, what it writes in ``writes.py``, storms and
silence matching in ``trainwarden.alerts`` (pure), the notifiers in ``notify/``.
:class:`AlertEngine` stays one class of some 600 lines: evaluation, the lifecycle and
routing share one pass's state (its caches of settled steps, due rules, silent runs and
deliveries), and reading it top to bottom is reading a pass.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, insert, or_, select

from trainwarden.alerts import Alert, Rule, advance, fingerprint
from trainwarden.alerts.evaluate import evaluate
from trainwarden.alerts.grouping import group_labels, group_note
from trainwarden.alerts.intervals import ZERO
from trainwarden.alerts.notification import Notification
from trainwarden.alerts.rules import (
    AbsenceRule,
    BaselineRule,
    EventRule,
    JobLostMatch,
    RateRule,
    ThresholdRule,
    action_kinds,
)
from trainwarden.alerts.silences import silence_matches
from trainwarden.alerts.snapshot import Snapshot, Verdict
from trainwarden.collector.alerting.snapshot import (
    Needs,
    SettledSteps,
    cadence_of,
    needs_of,
    snapshot,
)
from trainwarden.collector.alerting.writes import Writes, alert_of, finite_or_none, healed_alerts
from trainwarden.collector.ingest.limits import Pressure
from trainwarden.collector.loops import spaced
from trainwarden.collector.read.economics import EconomicsSettings
from trainwarden.collector.read.runbooks import runbook_url
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import leads, write

log = logging.getLogger(__name__)

ADVISORY_LOCK_KEY = 0x7477_616C_6572  # "twaler": one alert engine across collectors
OPEN = ("pending", "firing")
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


@dataclass
class _Entry:
    """An alert in a routing pass: what to send for it, and what to change on its row."""

    row: Any
    labels: dict[str, str]
    status: str | None = None  # "firing" or "resolved" to notify; None: nothing
    quiet: bool = False  # silenced or inhibited
    changes: dict[str, Any] = field(default_factory=dict)


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
            self._store_deliveries(conn)
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
            result.changed += self._advance_stored(
                writes, row, rule_, now, run_steps.get(row.run_id), healed=row.id in healed
            )
        for fp, (rule, v, labels, run, snap) in seen.items():
            result.changed += self._advance_active(
                writes, fp, open_rows.get(fp), rule, v, labels, run, snap, now
            )
        writes.flush(conn)
        result.notified = self._route(conn, now, notes, resting)
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

    def _advance_active(
        self,
        writes: Writes,
        fp: str,
        row: Any,
        rule: Rule,
        v: Verdict,
        labels: dict[str, str],
        run: Any,
        snap: Snapshot,
        now: float,
    ) -> int:
        alert = alert_of(row) if row is not None else Alert(rule.name, labels)
        new = advance(
            alert,
            active=True,
            now=now,
            step=snap.last_step,
            for_=rule.for_,
            keep_firing_for=rule.keep_firing_for,
            verdict_step=v.step,
            onset_step=v.onset_step,
        )
        info = snap.ranks.get(v.rank) if v.rank is not None else None
        annotations = {
            **(v.annotations or {}),
            "summary": rule.summary,
            "description": v.detail,
            "runbook_url": runbook_url(self.external_url, rule.runbook),
        }
        fields = dict(
            state=new.state,
            active_since=new.active_since,
            active_since_step=new.active_since_step,
            onset_step=new.onset_step,
            fired_at=new.fired_at,
            fired_at_step=new.fired_at_step,
            cleared_at=new.cleared_at,
            cleared_at_step=new.cleared_at_step,
            resolved_at=new.resolved_at,
            value=finite_or_none(v.value),
            step=v.step,
            annotations=annotations,
            node=info.node if info else None,
            gpu=info.gpu if info else None,
        )
        if row is None:
            writes.inserts.append(
                dict(
                    fingerprint=fp,
                    rule=rule.name,
                    run_id=run.id,
                    rank=v.rank,
                    severity=rule.severity,
                    labels=labels,
                    action=rule.action,
                    updated_at=now,
                    **fields,
                )
            )
            return 1
        same = (row.step, row.node, row.gpu) == (fields["step"], fields["node"], fields["gpu"])
        if new is alert and same:
            if row.value == fields["value"] and row.annotations == annotations:
                return 0
            # A hung rank's culprit named from the rings is news: written at once.
            named = (row.annotations or {}).get("collective") != annotations.get("collective")
            if not named and now - (row.updated_at or 0.0) < self.settings.refresh_s:
                return 0  # only its value or description moved: written now and then
        writes.updates.append({"b_id": row.id, "updated_at": now, **fields})
        return int(new is not alert)

    def _advance_stored(
        self,
        writes: Writes,
        row: Any,
        rule: Rule | None,
        now: float,
        step: int | None,
        *,
        healed: bool = False,
    ) -> int:
        """An open alert whose condition this pass did not find. ``healed``: an action
        carried out since it fired dealt with it (:func:`healed_alerts`), so it resolves
        once its condition has cleared, without waiting out ``keep_firing_for`` (a hold
        against flapping, and for an instant event to stay in view: the action dealt with
        it, and the resolve tells on-call so)."""
        alert = alert_of(row)
        if rule is None or healed:  # a rule removed from the pack: nothing to wait for
            new = advance(alert, active=False, now=now, step=step, for_=ZERO, keep_firing_for=ZERO)
        else:
            new = advance(
                alert,
                active=False,
                now=now,
                step=step,
                for_=rule.for_,
                keep_firing_for=rule.keep_firing_for,
            )
        if new is alert:
            return 0
        if new.state == "inactive":  # pending that never fired: forgotten
            writes.deletes.append(row.id)
            return 1
        writes.updates.append(
            dict(
                b_id=row.id,
                state=new.state,
                cleared_at=new.cleared_at,
                cleared_at_step=new.cleared_at_step,
                resolved_at=new.resolved_at,
                updated_at=now,
            )
        )
        return 1

    # -- silences, inhibition, notifications ---------------------------------------------

    def _route(self, conn: Connection, now: float, notes: list[Any], resting: set[int]) -> int:
        """Silences, inhibition and notifications of the alerts of the runs not ``resting``
        (routing is per run: inhibition and grouping never cross runs)."""
        a = m.alerts.c
        query = (
            select(m.alerts, m.runs.c.name.label("run_name"))
            .join(m.runs, m.runs.c.id == a.run_id)
            .where(or_(a.state.in_(OPEN), (a.state == "resolved") & (a.notified == "firing")))
        )
        if resting:
            query = query.where(a.run_id.not_in(resting))
        rows = conn.execute(query).all()
        if not rows:
            return 0
        si = m.silences.c
        silences = conn.execute(
            select(si.id, si.matchers).where(si.starts_at <= now, si.ends_at > now)
        ).all()
        # Inhibition sources: firing evict-action alerts per (run, node); firing liveness per (run,
        # rank).
        evicting: dict[tuple[int, str], int] = {}
        liveness: dict[tuple[int, int], int] = {}
        whole: dict[int, int] = {}  # a run's firing run-wide alert that explains its ranks'
        for r in rows:
            if r.state != "firing":
                continue
            if "evict" in action_kinds(r.action) and r.node:
                evicting.setdefault((r.run_id, r.node), r.id)
            if (r.labels or {}).get("category") == "liveness" and r.rank is not None:
                liveness.setdefault((r.run_id, r.rank), r.id)
            if (r.labels or {}).get("inhibits") == "ranks" and r.rank is None:
                whole.setdefault(r.run_id, r.id)
        entries: list[_Entry] = []
        for r in rows:
            labels = self._full_labels(r)
            silenced = next((s.id for s in silences if silence_matches(s.matchers, labels)), None)
            inhibited = whole.get(r.run_id) if r.rank is not None else None
            if inhibited is None and "evict" not in action_kinds(r.action) and r.node:
                inhibited = evicting.get((r.run_id, r.node))
            if inhibited is None and r.rank is not None and labels.get("category") != "liveness":
                inhibited = liveness.get((r.run_id, r.rank))
            entry = _Entry(r, labels)
            if (silenced, inhibited) != (r.silenced_by, r.inhibited_by):
                entry.changes.update(silenced_by=silenced, inhibited_by=inhibited)
            entry.quiet = quiet = silenced is not None or inhibited is not None
            if r.state == "firing" and not quiet:
                due = r.last_sent_at is None or (
                    r.acked_at is None and now - r.last_sent_at >= self.settings.resend_s
                )
                if r.notified != "firing" or due:
                    entry.status = "firing"
            elif r.state == "resolved" and r.notified == "firing":
                entry.status = "resolved"
            entries.append(entry)
        sets: dict[tuple[str, int], list[_Entry]] = {}
        for entry in entries:
            sets.setdefault((entry.row.rule, entry.row.run_id), []).append(entry)
        for members in sets.values():
            notes += self._storm(members, now)
        sent = 0
        writes = Writes()
        for entry in entries:
            if entry.changes:
                writes.updates.append({"b_id": entry.row.id, **entry.changes})
                sent += "notified" in entry.changes
        writes.flush(conn)
        return sent

    def _storm(self, entries: list[_Entry], now: float) -> list[Any]:
        """The notifications of one rule and run's alerts in this pass, storm or not.

        More than ``group_over`` alerts to page at once are one notification (their
        group's: :func:`group_note`), and alerts that fire while their group is still
        open join it: the group's notification is sent again with them (Alertmanager
        and PagerDuty update the page they have, by its fingerprint; nothing pages
        twice). An alert is resolved under the fingerprint it was paged under: its own,
        or, once none of its group is firing any more, the group's."""
        over = self.settings.group_over
        gfp = fingerprint(entries[0].row.rule, group_labels(entries[0].labels))
        in_group = [e for e in entries if e.row.notified == "firing" and e.row.notified_as == gfp]
        firing = [e for e in entries if e.status == "firing"]
        fresh = [e for e in firing if e.row.notified != "firing"]
        alone = [e for e in firing if e.row.notified == "firing" and e.row.notified_as != gfp]
        still = [e for e in in_group if e.row.state == "firing"]  # the group's open members
        notes: list[Any] = []
        group_due = any(e.status == "firing" for e in in_group)
        if group_due or (fresh and (still or len(fresh) > over)):
            members = [e for e in still if not e.quiet] + fresh  # silenced: not paged again
            notes.append(
                group_note([self._notification(e.row, e.labels, "firing") for e in members])
            )
            for e in members:  # one resend of the group, not one per member
                e.changes.update(notified="firing", notified_as=gfp, last_sent_at=now)
        else:
            alone += fresh
        for e in alone:
            notes.append(self._notification(e.row, e.labels, "firing"))
            e.changes.update(notified="firing", notified_as=e.row.fingerprint, last_sent_at=now)
        resolving = [e for e in entries if e.status == "resolved"]
        ended = [e for e in resolving if e.row.notified_as == gfp]
        # The others (``e not in ended`` compared whole entries: quadratic in a storm's
        # thousands of alerts, a fifth of the alert thread's time past capacity).
        for e in resolving:
            if e.row.notified_as != gfp:
                notes.append(self._notification(e.row, e.labels, "resolved"))
                e.changes.update(notified="resolved", last_sent_at=now)
        # A group's members that end while it is still open wait, paged as firing, for
        # its resolve, which then names every one of them (not those of its last pass).
        if ended and not any(e.changes.get("notified_as") == gfp for e in entries) and not still:
            notes.append(
                group_note([self._notification(e.row, e.labels, "resolved") for e in ended])
            )
            for e in ended:
                e.changes.update(notified="resolved", last_sent_at=now)
        return notes

    def _full_labels(self, r: Any) -> dict[str, str]:
        labels = {
            **(r.labels or {}),
            "alertname": r.rule,
            "severity": r.severity,
            "run": r.run_name,
        }
        for key in ("node", "gpu"):
            if getattr(r, key) is not None:
                labels[key] = str(getattr(r, key))
        return labels

    def _notification(self, r: Any, labels: dict[str, str], status: str) -> Any:
        base = (self.external_url or "").rstrip("/")
        return Notification(
            alert_id=r.id,
            fingerprint=r.fingerprint,
            status=status,  # type: ignore[arg-type]
            labels=labels,
            annotations=dict(r.annotations or {}),
            starts_at=r.fired_at or r.active_since,
            ends_at=r.resolved_at if status == "resolved" else None,
            generator_url=f"{base}/runs/{r.run_name}" if base else None,
        )

    def _send(self, note: Any) -> None:
        if self.submit is None:
            return
        try:
            self.submit(note)
        except Exception:
            log.exception("could not hand alert %s to the notifiers", note.fingerprint)

    def _store_deliveries(self, conn: Connection) -> None:
        batch = []
        while self.deliveries:
            batch.append(self.deliveries.popleft())
        if not batch:
            return
        known = set(
            conn.execute(
                select(m.alerts.c.id).where(m.alerts.c.id.in_({d.alert_id for d in batch}))
            ).scalars()
        )
        rows = [
            dict(
                alert_id=d.alert_id,
                receiver=d.receiver,
                kind=d.kind,
                status=d.status,
                attempt=d.attempt,
                ok=int(d.ok),
                http_status=d.http_status,
                error=(d.error or None) and d.error[:1000],
                at=d.at,
                duration_s=d.duration_s,
                final=int(d.final),
            )
            for d in batch
            if d.alert_id in known
        ]
        if rows:
            conn.execute(insert(m.alert_deliveries), rows)
