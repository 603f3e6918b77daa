"""The built-in per-step metrics, each declared once.

Two tables. :data:`FIELDS`: the numbers a rank sends for a step (a wire field of the
ingest body, the ``rank_steps`` column of the same name, an OpenTelemetry gauge).
:data:`METRICS`: the series the collector keeps across ranks (``step_stats``), which the
rules, the API and the pages name; most are one field, rolled up one way.

Everything else is derived from these two: the agent's OTLP map (``otlp.py``), the
collector's wire schema (``StepIn`` and its column-wise twin), the ``rank_steps`` and
``replaced_steps`` columns, the rollup (Python and SQL), the per-rank heatmap buckets,
the alerts' metric catalog (``trainwarden.alerts.metrics``) and the UI's colours and
lists. A metric the trainer gives (``given``) is recorded with the step method of the
same name (``s.lr(value)``), read off the training thread like the loss.

Standard library only: the node relay and the collector import it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class StepField:
    """A number a rank sends for a step: the wire field and ``rank_steps`` column ``name``."""

    name: str
    otlp: str
    """The OpenTelemetry gauge it is exported as (``trainwarden.step.*``)."""
    ucum: str
    """Its UCUM unit on that gauge."""
    integer: bool = False
    """An integer (a ``BigInteger`` column, at most int64), else a float."""
    minimum: int | None = 0
    """The least value ingest takes (inclusive); ``None``: any."""
    positive: bool = False
    """Greater than 0, not merely at least ``minimum``."""
    words: bool = False
    """NaN and infinities are kept: sent as ``"nan"``, ``"inf"``, ``"-inf"``, stored as
    NULL with the word in the row's ``issues``; else ingest refuses a non-finite value."""
    required: bool = False
    replaced: bool = False
    """Kept in ``replaced_steps`` when a rollback or a restart runs the step again."""
    given: bool = False
    """The trainer gives it, through the step method of the same name (``s.lr(x)``)."""
    description: str | None = None


Across = Literal["max", "mean", "sum", "derived"]


@dataclass(frozen=True)
class StepMetric:
    """A series kept across ranks, a step at a time (``step_stats.metric`` = ``name``)."""

    name: str
    label: str
    unit: str
    """As shown: ``s``, ``bytes``, ``tokens``, ``tokens/s``; empty for a ratio or a loss."""
    field: str | None
    """The field of :data:`FIELDS` that is its per-rank value; ``None``: computed from
    several (``trainwarden.alerts.metrics`` and its SQL twin define it)."""
    across: Across
    """Its run-level ``total`` at a step: the slowest rank's (``max``), the ranks' mean, their
    sum, or ``derived`` (defined with the per-rank value, where ``field`` is ``None``)."""
    color: str | None = None
    overview: bool = False
    """The run overview reads it (its rows, the step-time breakdown)."""
    extra: bool = False
    """Offered with the run's own metrics under the overview's figure, when the run has it."""
    heatmap: bool = False
    """Per-rank maxima over step buckets are kept (the Ranks page's rank x step heatmap)."""


_S = "s"

FIELDS: tuple[StepField, ...] = (
    StepField("duration_s", "trainwarden.step.duration", _S, required=True, replaced=True),
    StepField("data_wait_s", "trainwarden.step.data_wait", _S),
    StepField("tokens", "trainwarden.step.tokens", "{token}", integer=True),
    StepField(
        "loss",
        "trainwarden.step.loss",
        "1",
        minimum=None,
        words=True,
        replaced=True,
        description='NaN/Inf may be sent as "nan", "inf", "-inf"',
    ),
    StepField(
        "grad_norm",
        "trainwarden.step.grad_norm",
        "1",
        minimum=None,
        words=True,
        replaced=True,
        description="Global gradient norm; NaN/Inf as for loss",
    ),
    StepField("fwd_s", "trainwarden.step.phase.forward", _S, description="Forward phase"),
    StepField(
        "bwd_s",
        "trainwarden.step.phase.backward",
        _S,
        description="Backward phase (with the loss and the gradient-sync tail)",
    ),
    StepField("opt_s", "trainwarden.step.phase.optimizer", _S, description="Optimizer phase"),
    StepField("other_s", "trainwarden.step.phase.other", _S, description="The rest of the step"),
    StepField("compute_s", "trainwarden.step.compute", _S),
    StepField(
        "exposed_comm_s",
        "trainwarden.step.comm.exposed",
        _S,
        description="Waiting on collectives with no compute running",
    ),
    StepField(
        "overlapped_comm_s",
        "trainwarden.step.comm.overlapped",
        _S,
        description="Collective time hidden behind compute",
    ),
    StepField("idle_s", "trainwarden.step.idle", _S),
    StepField(
        "flops",
        "trainwarden.step.flops",
        "{flop}",
        description="Model FLOPs of the step on this rank",
    ),
    StepField("mfu", "trainwarden.step.mfu", "1"),
    StepField("peak_flops", "trainwarden.step.peak_flops", "{flop}/s", positive=True),
    StepField("mem_allocated_bytes", "trainwarden.step.memory.allocated", "By", integer=True),
    StepField("mem_reserved_bytes", "trainwarden.step.memory.reserved", "By", integer=True),
    StepField("rss_bytes", "trainwarden.step.memory.rss", "By", integer=True),
    StepField(
        "lr",
        "trainwarden.step.lr",
        "1",
        minimum=None,
        words=True,
        given=True,
        description="Learning rate the step's update used (s.lr); NaN/Inf as for loss",
    ),
)

_BLUE, _LIGHT_BLUE, _RED, _GREY, _VIOLET, _GREEN = (
    "#2563eb",
    "#60a5fa",
    "#dc2626",
    "#9ca3af",
    "#7c3aed",
    "#059669",
)

METRICS: tuple[StepMetric, ...] = (
    # The slowest rank's step time: the whole job waits for it.
    StepMetric(
        "step_time", "Step time", "s", "duration_s", "max", "#d97706", overview=True, heatmap=True
    ),
    StepMetric(
        "data_wait", "Data wait", "s", "data_wait_s", "max", _VIOLET, overview=True, heatmap=True
    ),
    StepMetric("loss", "Loss", "", "loss", "mean", _BLUE, overview=True, heatmap=True),
    StepMetric("tokens", "Tokens per step", "tokens", "tokens", "sum"),
    # All tokens over the slowest rank's time.
    StepMetric("tokens_per_s", "Throughput", "tokens/s", None, "derived", _GREEN, overview=True),
    # All ranks' FLOPs over the slowest rank's time x all ranks' peaks.
    StepMetric("mfu", "MFU", "", "mfu", "derived", "#0891b2", overview=True),
    StepMetric("grad_norm", "Grad norm", "", "grad_norm", "max", "#db2777", overview=True),
    # The parts of a step: their run-level value is the mean over ranks.
    StepMetric("compute", "Compute", "s", "compute_s", "mean", _BLUE, overview=True, heatmap=True),
    StepMetric(
        "exposed_comm",
        "Exposed comm",
        "s",
        "exposed_comm_s",
        "mean",
        _RED,
        overview=True,
        heatmap=True,
    ),
    StepMetric(
        "overlapped_comm",
        "Overlapped comm",
        "s",
        "overlapped_comm_s",
        "mean",
        _LIGHT_BLUE,
        overview=True,
    ),
    StepMetric("idle", "Idle", "s", "idle_s", "mean", _GREY),
    StepMetric("forward", "Forward", "s", "fwd_s", "mean", _BLUE),
    StepMetric("backward", "Backward", "s", "bwd_s", "mean", _LIGHT_BLUE),
    StepMetric("optimizer", "Optimizer", "s", "opt_s", "mean", _GREEN),
    StepMetric("other", "Other", "s", "other_s", "mean", _GREY),
    StepMetric("exposed_comm_frac", "Exposed comm / step", "", None, "derived"),
    StepMetric(
        "mem_allocated", "GPU memory (max allocated)", "bytes", "mem_allocated_bytes", "max"
    ),
    StepMetric("rss", "Host memory (peak RSS)", "bytes", "rss_bytes", "max"),
    StepMetric("lr", "Learning rate", "", "lr", "mean", "#ca8a04", extra=True),
)

FIELD = {f.name: f for f in FIELDS}
METRIC = {m.name: m for m in METRICS}
GIVEN = tuple(f.name for f in FIELDS if f.given)
"""The fields the trainer gives through a step method of the same name."""
EXTRAS = tuple(m.name for m in METRICS if m.extra)
"""The metrics a page's metric picker offers with the run's own (``user.<name>``)."""


def _check() -> None:
    for metric in METRICS:
        if metric.field is not None and metric.field not in FIELD:
            raise ValueError(f"metric {metric.name}: no field {metric.field!r}")
        if metric.field is None and metric.across != "derived":
            raise ValueError(f"metric {metric.name}: no field, so its total is derived")


_check()
