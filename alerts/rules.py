"""Alert rules: typed data, loaded from YAML and checked before anything evaluates them.

A rules file is a mapping with one key, ``rules``: a list of rules. Every rule has a
``kind`` and the ``params`` of that kind (no expression language: each kind is a
typed model), when it fires (``for``, ``keep_firing_for``), how bad it is
(``severity``), its ``labels``, the ``runbook`` that tells on-call what to do, and an
optional ``action`` for issue 7 to carry out. Metric names are checked against what
trainwarden stores: the per-step metrics of ``collector/rollups/aggregate.py`` (per rank, and
across ranks in ``step_stats``) and the numeric fields of ``gpu_samples``.

A broken file raises :class:`RuleError` whose lines each name the file, the rule and
the field: ``rules.yaml:12: rule 'LowMFU': for: '5 parsecs' is not a duration ...``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from trainwarden.agent.gpu import THROTTLE_REASONS, describe_xid
from trainwarden.alerts.metrics import METRICS

from .config_file import ConfigFileError, StrictModel
from .intervals import ZERO, After, Duration, Interval, Span, Unit

HERE = Path(__file__).resolve().parent
DEFAULT_RULES = HERE / "rules" / "default.yaml"
"""The rule pack trainwarden ships."""
RUNBOOKS_DIR = HERE.parent / "runbooks"
"""The shipped runbooks: ``runbooks/`` in a checkout, ``trainwarden/runbooks/`` in a wheel."""

# -- what rules may refer to ------------------------------------------------------

STEP_METRICS = tuple(METRICS)
"""Per-step metrics: each rank's value (``rank_steps``) and their rollups (``step_stats``)."""
RunStat = Literal["min", "median", "max", "p99", "mean", "total"]
RUN_STATS: tuple[str, ...] = get_args(RunStat)
"""A run metric's statistic across ranks; ``total`` is the run-level value (rollups.py)."""
GPU_METRICS = (
    "temp_c",
    "mem_temp_c",
    "power_w",
    "power_limit_w",
    "sm_clock_mhz",
    "sm_clock_max_mhz",
    "util_gpu",
    "util_mem",
    "mem_used_bytes",
    "mem_total_bytes",
    "ecc_corrected",
    "ecc_uncorrected",
    "retired_pages",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "remap_pending",
    "pcie_replay",
)
"""The numeric readings of ``gpu_samples`` (NVML, per rank); the collector's table has a
column for each (a test keeps the two the same)."""
NONFINITE_METRICS = tuple(name for name, m in METRICS.items() if m.source is not None)
"""Metrics stored from one column, whose NaN / Inf the collector marks in ``issues``."""
FLAGS = ("grad_norm_spike", "skip_suggested", "loss_spike", "nonfinite_loss", "nonfinite_grad_norm")
"""The spike flags the agent raises per step (agent/spikes.py)."""
RANK_STATES = ("healthy", "slow", "hung", "dead", "failed", "finished")
"""Rank states the health evaluator writes (collector/health/evaluator.py)."""
THROTTLES = tuple(THROTTLE_REASONS.values())
XidAction = Literal["ignore", "restart_app", "reset_gpu", "reboot_node", "drain"]
Severity = Literal["critical", "warning", "info"]
Action = Literal["none", "rollback", "evict", "stop", "evict+rollback"]
"""What a firing alert makes the action engine do. ``evict+rollback``: evict the alert's
node, then, once the job is back without it, roll every rank back to the newest clean
checkpoint (a restarted job resumes from its newest one, which may hold what the alert
found: silent data corruption)."""


def action_kinds(action: str) -> tuple[str, ...]:
    """The actions (``actions.kind``) a rule's ``action`` takes, in order."""
    return () if action == "none" else tuple(action.split("+"))


EventName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$", max_length=64)]

_LABEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_LABELS = frozenset({"alertname", "severity", "run", "rank", "node", "gpu"})
"""Labels the engine sets on every alert; a rule cannot set them."""
_RUNBOOK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.md")


class RuleError(ConfigFileError):
    """A rules file that cannot be used; one line per problem, each naming file, rule, field."""


class _FieldError(ValueError):
    """A check across fields that blames one of them (pydantic puts it on the model)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _known(value: str, known: Iterable[str], what: str) -> str:
    names = list(known)
    if value not in names:
        raise ValueError(f"{value!r} is not {what}; known: {', '.join(names)}")
    return value


def _one_of(model: BaseModel, *fields: str) -> None:
    given = [f for f in fields if getattr(model, f) is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {', '.join(fields)} (got {len(given)})")


class _Strict(StrictModel):
    model_config = ConfigDict(frozen=True)


# -- parameters of each kind ------------------------------------------------------


class _MetricParams(_Strict):
    """A stored metric: ``run`` (across ranks, one value per step, ``stat`` picks which),
    ``rank`` (each rank's own value per step) or ``gpu`` (each rank's NVML samples)."""

    scope: Literal["run", "rank", "gpu"]
    metric: str
    stat: RunStat | None = Field(default=None, validate_default=True)
    window: Span | None = None
    """Compare the median over this window (steps or time); default: the latest value."""

    @field_validator("metric")
    @classmethod
    def _stored(cls, value: str, info: ValidationInfo) -> str:
        scope = info.data.get("scope")
        if scope is None:
            return value  # the scope's own error is reported
        known = GPU_METRICS if scope == "gpu" else STEP_METRICS
        return _known(value, known, f"a {scope} metric trainwarden stores")

    @field_validator("stat")
    @classmethod
    def _run_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        scope = info.data.get("scope")
        if scope == "run":
            return value or "total"
        if value is not None and scope is not None:
            raise ValueError(f"only run metrics have a stat across ranks (scope is {scope!r})")
        return value

    @field_validator("window")
    @classmethod
    def _gpu_time(cls, value: Interval | None, info: ValidationInfo) -> Interval | None:
        if value is not None and value.unit == "steps" and info.data.get("scope") == "gpu":
            raise ValueError("GPU samples are timed, not stepped: use a duration ('1m')")
        return value


class ThresholdParams(_MetricParams):
    """The value is above or below a fixed number."""

    above: float | None = None
    below: float | None = None
    fraction_of_step: bool = False
    """Divide a time metric by the step time of the same rank (or stat) and step."""

    @model_validator(mode="after")
    def _check(self) -> ThresholdParams:
        _one_of(self, "above", "below")
        if self.fraction_of_step and (self.scope == "gpu" or METRICS[self.metric].unit != "s"):
            raise _FieldError("fraction_of_step", "needs a run or rank metric in seconds")
        return self


class BaselineParams(_MetricParams):
    """The value against its own recent past: the median over ``baseline`` just before
    the current ``window``, of the run (scope run) or of each rank (scope rank)."""

    scope: Literal["run", "rank"]
    baseline: Span = Interval(500, "steps")
    warmup: Span = ZERO
    """Ignore the start of the run (compilation, cache warm-up) and of every restart."""
    ratio_above: float | None = Field(default=None, gt=1)
    ratio_below: float | None = Field(default=None, gt=0, lt=1)

    @model_validator(mode="after")
    def _check(self) -> BaselineParams:
        _one_of(self, "ratio_above", "ratio_below")
        return self


class PeerParams(_Strict):
    """Each rank against its peers at the same step: the ratio to the median of the
    other ranks, or a robust z-score (median and MAD across ranks)."""

    metric: str
    ratio_above: float | None = Field(default=None, gt=1)
    ratio_below: float | None = Field(default=None, gt=0, lt=1)
    z_above: float | None = Field(default=None, gt=0)
    min_ranks: int = Field(default=2, ge=2)

    @field_validator("metric")
    @classmethod
    def _stored(cls, value: str) -> str:
        return _known(value, STEP_METRICS, "a rank metric trainwarden stores")

    @model_validator(mode="after")
    def _check(self) -> PeerParams:
        _one_of(self, "ratio_above", "ratio_below", "z_above")
        if self.z_above is not None and self.min_ranks < 3:
            raise _FieldError("min_ranks", "a z-score needs at least 3 ranks")
        return self


class XidMatch(_Strict):
    """An XID the agent reported: by code, or by the catalog's recommended action."""

    stateful: ClassVar[bool] = False
    match: Literal["xid"]
    codes: tuple[Annotated[int, Field(ge=1)], ...] = ()
    actions: tuple[XidAction, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> XidMatch:
        if not self.codes and not self.actions:
            raise ValueError("give codes, actions (from agent/data/xid_catalog.json), or both")
        return self

    def matches(self, code: int) -> bool:
        """Whether XID ``code`` is one of ``codes`` or its catalog action one of ``actions``."""
        return code in self.codes or describe_xid(code)["action"] in self.actions


class FlagMatch(_Strict):
    """A spike flag the agent raised on a rank's step."""

    stateful: ClassVar[bool] = False
    match: Literal["flag"]
    flags: tuple[Literal[FLAGS], ...] = Field(min_length=1)  # type: ignore[valid-type]


class NonFiniteMatch(_Strict):
    """A NaN or Inf that a rank reported for a metric (stored as such, marked in ``issues``)."""

    stateful: ClassVar[bool] = False
    match: Literal["nonfinite"]
    metrics: tuple[str, ...] = Field(min_length=1)

    @field_validator("metrics")
    @classmethod
    def _stored(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            _known(name, NONFINITE_METRICS, "a metric stored from one column")
        return value


class RankStateMatch(_Strict):
    """A rank is in one of these states (and, if given, in this role)."""

    stateful: ClassVar[bool] = True
    match: Literal["rank_state"]
    to: tuple[Literal[RANK_STATES], ...] = Field(min_length=1)  # type: ignore[valid-type]
    role: Literal["culprit", "victim"] | None = None


class ThrottleMatch(_Strict):
    """A rank's GPU reports one of these clock throttle reasons."""

    stateful: ClassVar[bool] = True
    match: Literal["throttle"]
    reasons: tuple[Literal[THROTTLES], ...] = Field(min_length=1)  # type: ignore[valid-type]


class EventKindMatch(_Strict):
    """Any stored event of these kinds (``restart``, ``loss_divergence``, your own ...)."""

    stateful: ClassVar[bool] = False
    match: Literal["event"]
    events: tuple[EventName, ...] = Field(min_length=1)
    per_rank: bool = False
    """One alert per rank the events name (and so a node an eviction can act on),
    instead of one for the run."""


class JobLostMatch(_Strict):
    """A job that dies with a collective verdict standing: a rank the verdict placed
    (its state detail names the collective: culprit or victim) is gone, dead (no
    heartbeat for ``after_beats`` of its intervals, as ``RankDead`` counts) or ended with
    a goodbye; or a rank of the run's current attempt died of a signal (its last words,
    ``rank_crashed``). One alert for the run, whose description is the verdict."""

    stateful: ClassVar[bool] = True
    match: Literal["job_lost"]
    after_beats: float = Field(default=2.25, gt=0, le=1000)


Match = (
    XidMatch
    | FlagMatch
    | NonFiniteMatch
    | RankStateMatch
    | ThrottleMatch
    | EventKindMatch
    | JobLostMatch
)
EventMatch = Annotated[Match, Field(discriminator="match")]
MATCHES = ("xid", "flag", "nonfinite", "rank_state", "throttle", "event", "job_lost")


class AbsenceParams(_Strict):
    """Something expected has not happened for ``after``: a rank's heartbeat (in
    heartbeat intervals or time), a rank's progress (in median step times or time),
    or an event of the run (time). Only live ranks are watched: a rank that finished or
    failed (and said so) is not missing."""

    signal: Literal["heartbeat", "progress", "event"]
    event: EventName | None = None
    after: After
    at_least: Duration | None = None
    """A floor under a relative ``after`` (N beats or N steps)."""

    @model_validator(mode="after")
    def _check(self) -> AbsenceParams:
        if (self.signal == "event") != (self.event is not None):
            raise _FieldError("event", "give an event kind exactly when signal is 'event'")
        allowed: dict[str, tuple[Unit, ...]] = {
            "heartbeat": ("s", "beats"),
            "progress": ("s", "steps"),
            "event": ("s",),
        }
        if self.after.unit not in allowed[self.signal]:
            raise _FieldError("after", f"'{self.after}' does not measure a missing {self.signal}")
        if self.at_least is not None and self.after.unit == "s":
            raise _FieldError("at_least", "only a relative 'after' (beats, steps) needs a floor")
        return self


class RateParams(_Strict):
    """At least ``at_least`` matches within ``window``, per run or per rank."""

    count: EventMatch
    window: Span
    at_least: int = Field(ge=1)
    per: Literal["run", "rank"] = "run"

    @model_validator(mode="after")
    def _countable(self) -> RateParams:
        if isinstance(self.count, JobLostMatch):
            raise _FieldError("count", "a job is lost once: 'job_lost' is for an event rule")
        return self


class CadenceParams(_Strict):
    """The run's checkpoint interval is more than ``off_by`` times longer or shorter than
    the advisor's optimum T* = sqrt(2 C tau) (``collector/read/economics.py``), once it has
    seen ``min_checkpoints`` checkpoints with their blocking save time."""

    off_by: float = Field(default=2.0, gt=1, le=1000)
    min_checkpoints: int = Field(default=3, ge=2, le=10_000)
    min_saving: float = Field(default=0.005, ge=0, le=1)
    """Fire only if T* would waste at least this fraction of the run's time less than the
    current interval (0.005: half a percent). Far off T* can still be free: a save of
    0.05 s every 15 s wastes 0.3 %, and 'save less often' would gain nothing to speak of."""


# -- rules --------------------------------------------------------------------------


class _Rule(_Strict):
    model_config = ConfigDict(populate_by_name=True)

    name: str
    kind: str
    summary: str = Field(min_length=1, max_length=300)
    """One line for notifications: what is wrong."""
    for_: Span = Field(default=ZERO, alias="for")
    keep_firing_for: Span = ZERO
    severity: Severity
    labels: dict[str, str] = Field(default_factory=dict)
    runbook: str
    action: Action = "none"

    @property
    def per_rank(self) -> bool:
        """Whether each alert of this rule names a rank (and so a node to evict)."""
        raise NotImplementedError

    def _for_units(self) -> tuple[Unit, ...]:
        return ("s", "steps")

    @field_validator("name")
    @classmethod
    def _word(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,63}", value):
            raise ValueError(f"{value!r}: use letters, digits and _ (it names alerts and runbooks)")
        return value

    @field_validator("labels")
    @classmethod
    def _label_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _LABEL.fullmatch(key):
                raise ValueError(f"{key!r} is not a label name (letters, digits, _)")
            if key in RESERVED_LABELS:
                raise ValueError(f"{key!r} is set by trainwarden on every alert")
        return value

    @field_validator("runbook")
    @classmethod
    def _runbook_exists(cls, value: str, info: ValidationInfo) -> str:
        if not _RUNBOOK.fullmatch(value):
            raise ValueError(f"{value!r} is not a Markdown file name like 'LowMFU.md'")
        dirs: Sequence[Path] = (info.context or {}).get("runbooks_dirs", ())
        if dirs and not any((d / value).is_file() for d in dirs):
            raise ValueError(f"{value!r} is not in {' or '.join(str(d) for d in dirs)}")
        return value

    @model_validator(mode="after")
    def _common(self) -> _Rule:
        units = self._for_units()
        for field, span in (("for", self.for_), ("keep_firing_for", self.keep_firing_for)):
            if span.unit not in units:
                raise _FieldError(field, "this rule counts time, not steps: use a duration ('5m')")
        if "evict" in action_kinds(self.action) and not self.per_rank:
            raise _FieldError("action", "evict needs a rule whose alerts name a rank")
        return self


class ThresholdRule(_Rule):
    kind: Literal["threshold"]
    params: ThresholdParams

    @property
    def per_rank(self) -> bool:
        return self.params.scope != "run"

    def _for_units(self) -> tuple[Unit, ...]:
        return ("s",) if self.params.scope == "gpu" else ("s", "steps")


class BaselineRule(_Rule):
    kind: Literal["baseline"]
    params: BaselineParams

    @property
    def per_rank(self) -> bool:
        return self.params.scope == "rank"


class PeerRule(_Rule):
    kind: Literal["peer"]
    params: PeerParams

    @property
    def per_rank(self) -> bool:
        return True


class EventRule(_Rule):
    kind: Literal["event"]
    params: EventMatch

    @property
    def per_rank(self) -> bool:
        if isinstance(self.params, JobLostMatch):
            return False  # one for the run: the job is lost, not a rank
        return self.params.match != "event" or self.params.per_rank

    def _for_units(self) -> tuple[Unit, ...]:
        return ("s",)

    @model_validator(mode="after")
    def _instant(self) -> EventRule:
        if not self.params.stateful and self.for_ != ZERO:
            raise _FieldError(
                "for",
                f"'{self.params.match}' matches are instants that fire at once: "
                "hold one with keep_firing_for, or need several with a rate rule",
            )
        return self


class AbsenceRule(_Rule):
    kind: Literal["absence"]
    params: AbsenceParams

    @property
    def per_rank(self) -> bool:
        return self.params.signal != "event"

    def _for_units(self) -> tuple[Unit, ...]:
        return ("s",)


class RateRule(_Rule):
    kind: Literal["rate"]
    params: RateParams

    @property
    def per_rank(self) -> bool:
        return self.params.per == "rank"


class CadenceRule(_Rule):
    kind: Literal["cadence"]
    params: CadenceParams = Field(default_factory=CadenceParams)

    @property
    def per_rank(self) -> bool:
        return False

    def _for_units(self) -> tuple[Unit, ...]:
        return ("s",)


Rule = ThresholdRule | BaselineRule | PeerRule | EventRule | AbsenceRule | RateRule | CadenceRule
KINDS: dict[str, type[_Rule]] = {
    "threshold": ThresholdRule,
    "baseline": BaselineRule,
    "peer": PeerRule,
    "event": EventRule,
    "absence": AbsenceRule,
    "rate": RateRule,
    "cadence": CadenceRule,
}
