"""``POST /api/v1/ingest/columns``: several ranks' headers and steps column-wise
(``ColumnarBatch``), each column validated in one pass against ``AgentInfo``'s and
``StepIn``'s constraints."""

from __future__ import annotations

import itertools
import math
import time
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    model_validator,
)

from trainwarden.agent.metric_catalog import FIELDS
from trainwarden.collector.ingest import user_metrics
from trainwarden.collector.ingest.schema_checks import (
    MAX_FUTURE_S,
    MAX_RECORDS_PER_BATCH,
    MIN_TS,
    PROBE_WITHOUT_CHECK,
    RUN_NAME_PATTERN,
    SAMPLES_WITHOUT_DIGEST,
    all_finite,
    check_int64,
    check_sources,
    not_in_the_future,
)
from trainwarden.collector.ingest.schema_steps import StepIn
from trainwarden.collector.ingest.schemas import AGENT_FIELDS, AgentInfo, IngestBatch

STEP_COLUMNS = frozenset(StepIn.model_fields)


def _agent_column_model() -> type[BaseModel]:
    """``AgentInfo`` turned column-wise (``world_size`` is the batch's): each field a list
    of its type with its constraints, validated in one pass, with no object a rank. A
    field with a default may be left out (every rank takes the default)."""
    fields: dict[str, Any] = {}
    for name, info in AgentInfo.model_fields.items():
        if name == "world_size":
            continue
        args = (info.annotation, *info.metadata)
        item = Annotated[args] if info.metadata else info.annotation  # type: ignore[valid-type]
        column = Annotated[list[item], Field(max_length=65_536)]  # type: ignore[valid-type]
        fields[name] = (column, ...) if info.is_required() else (column | None, None)
    return create_model(
        "AgentColumns",
        __doc__="The ranks' headers column-wise: a field of ``AgentInfo`` (but ``world_size``, "
        "the batch's) to a list with one value a rank, all lists of one length.",
        **fields,
    )


AgentColumns = _agent_column_model()
_AGENT_DEFAULTS = {
    name: info.default for name, info in AgentInfo.model_fields.items() if not info.is_required()
}
_AGENT_TIMES = ("started_at", "sent_at", "last_step_end")


class ColumnarBatch(BaseModel):
    """``POST /api/v1/ingest/columns``: several ranks' steps in one request, column-wise.

    For node relays and load generators: the ranks' headers come either as
    ``agents`` (one ``AgentInfo`` a rank in the request) or as ``agent_columns`` (the same
    fields column-wise: one list a field, a value a rank; cheaper to check and to store);
    ``steps`` maps a step field (as in ``StepIn``) plus ``rank`` to a list, all lists of
    one length. ``extras``: whole per-rank batches of the same run, for what has no columns
    (events, GPU samples): a node relay (``trainwarden relay``) sends its ranks' steps as
    columns and their events and GPU samples this way, all in one request.
    """

    run: str = Field(pattern=RUN_NAME_PATTERN)
    world_size: int = Field(ge=1, le=1_000_000)
    agents: list[AgentInfo] = Field(default_factory=list, max_length=65_536)
    agent_columns: AgentColumns | None = None  # type: ignore[valid-type]
    steps: dict[str, list[Any]] = Field(default_factory=dict)
    extras: list[IngestBatch] = Field(default_factory=list, max_length=4096)

    @model_validator(mode="before")
    @classmethod
    def _agents_share_the_world(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("agents"), list):
            data = {
                **data,
                "agents": [
                    {"world_size": data.get("world_size"), **a} if isinstance(a, dict) else a
                    for a in data["agents"]
                ],
            }
        return data

    @model_validator(mode="after")
    def _columns(self) -> ColumnarBatch:
        self._heads = self._header_columns()
        for i, extra in enumerate(self.extras):
            if extra.run != self.run:
                raise ValueError(
                    f"extras row {i}: run {extra.run!r} is not this batch's {self.run!r}"
                )
        if not self.steps:
            self._cols = {}
            return self
        unknown = set(self.steps) - STEP_COLUMNS - {"rank"}
        if unknown:
            raise ValueError(
                f"unknown step columns {sorted(unknown)}; known: {sorted(STEP_COLUMNS)}"
            )
        missing = {"rank", "step", "ts", "duration_s"} - set(self.steps)
        if missing:
            raise ValueError(f"missing step columns {sorted(missing)}")
        lengths = {name: len(values) for name, values in self.steps.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"step columns differ in length: {lengths}")
        if lengths["rank"] > MAX_RECORDS_PER_BATCH * 4:
            raise ValueError(f"at most {MAX_RECORDS_PER_BATCH * 4} step rows per request")
        heads = self._heads["rank"]
        if self.steps["rank"] != heads:  # else: a row a rank, in the headers' order
            stray = set(self.steps["rank"]) - set(heads)
            if stray:
                which = "agent_columns" if self.agent_columns is not None else "agents"
                raise ValueError(
                    f"step rows for ranks {sorted(stray)[:5]} that have no entry in {which}"
                )
        self._cols = _validate_columns(self.steps)  # every value checked here, at the edge
        return self

    def _header_columns(self) -> dict[str, list[Any]]:
        if self.agent_columns is None:
            if not self.agents:
                raise ValueError("no ranks: send their headers as agents or agent_columns")
            return {name: [getattr(a, name) for a in self.agents] for name in AGENT_FIELDS}
        if self.agents:
            raise ValueError("send the ranks' headers as agents or as agent_columns, not both")
        given = {name: v for name, v in self.agent_columns.__dict__.items() if v is not None}
        lengths = {name: len(values) for name, values in given.items()}
        n = lengths["rank"]
        if len(set(lengths.values())) != 1:
            raise ValueError(f"agent_columns differ in length: {lengths}")
        if not 1 <= n <= 65_536:
            raise ValueError(f"agent_columns: {n} ranks; from 1 to 65,536 a request")
        heads = {
            name: given.get(name) or [_AGENT_DEFAULTS[name]] * n
            if name != "world_size"
            else [self.world_size] * n
            for name in AGENT_FIELDS
        }
        ranks = heads["rank"]
        if max(ranks) >= self.world_size:
            i = next(i for i, rank in enumerate(ranks) if rank >= self.world_size)
            raise ValueError(
                f"agent_columns row {i}: rank {ranks[i]} is outside world_size {self.world_size}"
            )
        horizon = time.time() + MAX_FUTURE_S
        for name in _AGENT_TIMES:  # as AgentInfo checks each: after 1970, not a day ahead
            values = given.get(name)
            if not values:
                continue
            known = [t for t in values if t is not None] if None in values else values
            if known and all_finite(known) and min(known) >= MIN_TS and max(known) <= horizon:
                continue
            for i, ts in enumerate(values):
                if ts is not None:
                    try:
                        not_in_the_future(ts)
                    except ValueError as exc:
                        raise ValueError(f"agent_columns row {i}: {name}: {exc}") from None
        return heads

    _cols: dict[str, list[Any]] = PrivateAttr(default_factory=dict)
    _heads: dict[str, list[Any]] = PrivateAttr(default_factory=dict)

    # The two below read the private attributes' dict directly: ``self._cols`` goes
    # through pydantic's __getattr__ (a Python call), and the writer asks per request.

    def columns(self) -> dict[str, list[Any]]:
        """The validated step columns: ``rank`` and the fields sent, all of one length
        (the writer keeps them column-wise: no object a row)."""
        return self.__pydantic_private__["_cols"]  # type: ignore[index]

    def header_columns(self) -> dict[str, list[Any]]:
        """The ranks' headers column-wise, whichever way they came: every ``AgentInfo``
        field (defaults filled in) to a list with a value a rank."""
        return self.__pydantic_private__["_heads"]  # type: ignore[index]

    def rows(self) -> list[tuple[int, dict[str, Any]]]:
        """(rank, step fields) pairs: the fields sent."""
        cols = dict(self._cols)
        ranks = cols.pop("rank", [])
        names = list(cols)
        return [
            (rank, dict(zip(names, values, strict=True)))
            for rank, values in zip(ranks, zip(*cols.values(), strict=True), strict=True)
        ]


def _column_model() -> type[BaseModel]:
    """``StepIn`` turned column-wise: each field a list of its type with its constraints,
    so a node's rows are validated in one pass instead of one model per row."""
    fields: dict[str, Any] = {"rank": (list[Annotated[int, Field(ge=0)]], ...)}
    for name, info in StepIn.model_fields.items():
        args = (info.annotation, *info.metadata)
        item = Annotated[args] if info.metadata else info.annotation  # type: ignore[valid-type]
        fields[name] = (list[item] | None, None)  # type: ignore[valid-type]
    return create_model("StepColumns", **fields)


_STEP_COLUMNS_MODEL = _column_model()
_WORDS = tuple(f.name for f in FIELDS if f.words)  # NaN/Inf may come as words, as in ``StepIn``
_FINITE_COLUMNS = tuple(
    name
    for name in StepIn.model_fields
    if name not in _WORDS and StepIn.model_fields[name].annotation in (float, float | None)
)
_NONFINITE_WORDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _validate_columns(steps: dict[str, list[Any]]) -> dict[str, list[Any]]:
    for name in _WORDS:
        values = steps.get(name)
        if values and str in map(type, values):
            steps = {
                **steps,
                name: [_NONFINITE_WORDS.get(v, v) if isinstance(v, str) else v for v in values],
            }
    try:
        cols = _STEP_COLUMNS_MODEL.model_validate(steps)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        loc = error["loc"]
        field = ".".join(map(str, (loc[0], *loc[2:])))  # a user metric's key follows its row
        where = f"steps row {loc[1]}: {field}" if len(loc) > 1 else f"steps: {loc[0]}"
        raise ValueError(f"{where}: {error['msg']}") from None
    fields = cols.__dict__
    columns = {name: fields[name] for name in steps}
    if columns.get("metrics"):
        user_metrics.check_column(columns["metrics"])
    finite = [values for name in _FINITE_COLUMNS if (values := columns.get(name))]
    if not all_finite(itertools.chain.from_iterable(finite)):  # one C loop for them all
        for name in _FINITE_COLUMNS:  # the column and row at fault
            values = columns.get(name)
            if values and not all_finite(values):
                for i, value in enumerate(values):
                    if value is not None and not math.isfinite(value):
                        raise ValueError(f"steps row {i}: {name}: must be a finite number")
    kept, epochs = columns.get("samples_kept"), columns.get("samples_epoch")
    if kept or epochs:
        digests = columns.get("samples_digest") or [None] * len(columns["ts"])
        for i, digest in enumerate(digests):
            if digest is None and (
                (kept is not None and kept[i] is not None)
                or (epochs is not None and epochs[i] is not None)
            ):
                raise ValueError(f"steps row {i}: {SAMPLES_WITHOUT_DIGEST}")
    for i, ids in enumerate(kept or ()):
        if ids:
            try:
                check_int64(ids)
            except ValueError as exc:
                raise ValueError(f"steps row {i}: {exc}") from None
    if columns.get("data_sources"):
        for i, sources in enumerate(columns["data_sources"]):
            if sources:
                try:
                    check_sources(sources)
                except ValueError as exc:
                    raise ValueError(f"steps row {i}: {exc}") from None
    if columns.get("probe"):
        prints = columns.get("fingerprint") or [None] * len(columns["probe"])
        for i, (probe, fp) in enumerate(zip(columns["probe"], prints, strict=True)):
            if probe is not None and fp is None:
                raise ValueError(f"steps row {i}: {PROBE_WITHOUT_CHECK}")
    horizon = time.time() + MAX_FUTURE_S
    ts = columns["ts"]
    if not MIN_TS <= min(ts) <= max(ts) <= horizon:
        i = next(i for i, t in enumerate(ts) if not MIN_TS <= t <= horizon)
        try:
            not_in_the_future(ts[i])
        except ValueError as exc:
            raise ValueError(f"steps row {i}: ts: {exc}") from None
    return columns
