"""Alerts and the response to them: alert episodes, their notifications and silences,
the actions taken (and the commands they send to ranks), incidents and the operator
logbook."""

from __future__ import annotations

from sqlalchemy import Column, ForeignKey, Index, Table
from sqlalchemy.types import JSON, BigInteger, Float, Integer, String

from trainwarden.collector.store.table_base import metadata

# -- alerts (migration 0007) ---------------------------------------------------------
# One row per episode of an alert: a fingerprint (rule + labels) that goes pending,
# maybe fires, and resolves. A pending episode that clears before it fires is deleted,
# as Prometheus forgets it. The engine (collector/alerting/engine.py) is the only writer
# besides acknowledgements.

alerts = Table(
    "alerts",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("fingerprint", String(32), nullable=False),
    Column("rule", String(64), nullable=False),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("rank", Integer),
    Column("node", String(255)),
    Column("gpu", String(64)),
    Column("severity", String(16), nullable=False),
    Column("state", String(16), nullable=False),  # pending | firing | resolved
    Column("labels", JSON, nullable=False),
    Column("annotations", JSON, nullable=False),
    Column("value", Float),
    Column("step", BigInteger),
    Column("action", String(16), nullable=False, server_default="none"),
    Column("active_since", Float, nullable=False),
    Column("active_since_step", BigInteger),
    Column("onset_step", BigInteger),  # where the anomaly began in the data (0023)
    Column("fired_at", Float),
    Column("fired_at_step", BigInteger),  # the step it fired at (0019)
    Column("cleared_at", Float),
    Column("cleared_at_step", BigInteger),
    Column("resolved_at", Float),
    Column("updated_at", Float, nullable=False),
    Column("acked_at", Float),
    Column("acked_by", String(128)),
    Column("ack_comment", String(1000)),
    Column("silenced_by", Integer),
    Column("inhibited_by", Integer),
    Column("notified", String(16)),  # the last status sent to the notifiers
    # The fingerprint it was last notified under: its own, or its storm group's.
    Column("notified_as", String(32)),
    Column("last_sent_at", Float),
    Index("ix_alerts_state", "state"),
    Index("ix_alerts_run_id_active_since", "run_id", "active_since"),
    Index("ix_alerts_fingerprint", "fingerprint"),
)

alert_deliveries = Table(
    "alert_deliveries",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("alert_id", Integer, ForeignKey("alerts.id", ondelete="CASCADE"), nullable=False),
    Column("receiver", String(64), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("status", String(16), nullable=False),  # the notification's: firing | resolved
    Column("attempt", Integer, nullable=False),
    Column("ok", Integer, nullable=False),
    Column("http_status", Integer),
    Column("error", String(1000)),
    Column("at", Float, nullable=False),
    Column("duration_s", Float, nullable=False),
    Column("final", Integer, nullable=False),
    Index("ix_alert_deliveries_alert_id", "alert_id"),
)

silences = Table(
    "silences",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("matchers", JSON, nullable=False),  # [{name, value, regex}]
    Column("starts_at", Float, nullable=False),
    Column("ends_at", Float, nullable=False),
    Column("created_by", String(128), nullable=False),
    Column("comment", String(1000), nullable=False),
    Column("created_at", Float, nullable=False),
)

# -- actions (migration 0008) --------------------------------------------------------
# What trainwarden does about an alert (or an operator asks for): a rollback of the run
# to a good checkpoint, the eviction of a node, a stop. Each is a row with a state
# machine (proposed -> approved -> executing -> done | failed | cancelled) and its
# history; commands to ranks ride back on the agents' own ingest requests.

actions = Table(
    "actions",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("kind", String(16), nullable=False),  # rollback | evict | stop
    Column("state", String(16), nullable=False),
    Column("mode", String(16), nullable=False),  # auto | require-ack | dry-run
    Column("trigger", String(128), nullable=False),  # "rule:LossSpike" | "operator:ana"
    Column("alert_id", Integer),
    Column("fingerprint", String(64)),  # idempotency: one action per alert episode and kind
    Column("rank", Integer),
    Column("node", String(255)),
    Column("approver", String(128)),
    Column("plan", JSON(none_as_null=True)),
    Column("result", JSON(none_as_null=True)),
    Column("reason", String(2000)),  # why it failed or was cancelled
    Column("history", JSON, nullable=False),  # [{at, state, by, detail}]
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("finished_at", Float),
    Index("ix_actions_state", "state"),
    Index("ix_actions_run_id_created_at", "run_id", "created_at"),
    Index("ix_actions_fingerprint", "fingerprint"),
)

agent_commands = Table(
    "agent_commands",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    # None: a request of the health evaluator or an operator, not an action's (migration
    # 0024): read the Flight Recorder ({"type": "collectives"}).
    Column("action_id", Integer, ForeignKey("actions.id", ondelete="CASCADE")),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("body", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("delivered_at", Float),
    Column("done_at", Float),  # acknowledged by the rank, or no longer needed
    Index("ix_agent_commands_run_id_rank", "run_id", "rank"),
)

# -- incidents and the operator logbook (migration 0009) ----------------------------
# An incident groups what happened to a run around one problem: the alerts that fired,
# the actions taken, and (by time) the run's events and notes. The incident engine
# (collector/incidents/store.py) opens one on the first firing alert of a run, gathers what
# follows and closes it once everything resolved and a cool-down passed; operators
# open, close, merge and retitle them through the API.

incidents = Table(
    "incidents",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("title", String(200), nullable=False),
    Column("state", String(16), nullable=False),  # open | closed | merged
    Column("severity", String(16), nullable=False),
    Column("auto", Integer, nullable=False),  # opened by the engine, which also closes it
    Column("opened_at", Float, nullable=False),
    Column("opened_by", String(128), nullable=False),
    Column("closed_at", Float),
    Column("closed_by", String(128)),
    Column("summary", String(2000)),
    Column("merged_into", Integer),
    Column("ranks", JSON, nullable=False),  # the ranks and nodes involved
    Column("nodes", JSON, nullable=False),
    Column("history", JSON, nullable=False),  # [{at, what, by, detail}]
    Column("updated_at", Float, nullable=False),
    Column("posted_at", Float),  # the report posted on close (serve --postmortem-post)
    Column("post_status", String(300)),
    Index("ix_incidents_run_id_opened_at", "run_id", "opened_at"),
    Index("ix_incidents_state", "state"),
)

# Which alerts and actions belong to which incident: each to one at most.
incident_items = Table(
    "incident_items",
    metadata,
    Column("kind", String(16), primary_key=True),  # alert | action
    Column("item_id", Integer, primary_key=True),
    Column("incident_id", Integer, ForeignKey("incidents.id", ondelete="CASCADE"), nullable=False),
    Column("added_at", Float, nullable=False),
    Index("ix_incident_items_incident_id", "incident_id"),
)

notes = Table(
    "notes",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("incident_id", Integer, ForeignKey("incidents.id", ondelete="SET NULL")),
    Column("author", String(128), nullable=False),
    Column("text", String(10_000), nullable=False),
    Column("at", Float, nullable=False),  # what the note is about (default: when written)
    Column("step", BigInteger),
    Column("created_at", Float, nullable=False),
    Index("ix_notes_run_id_at", "run_id", "at"),
)
