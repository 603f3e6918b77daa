"""Property tests (hypothesis) for what users and agents hand trainwarden as text or
JSON: the drill spec, a rules file's rules, and the ingest bodies (row-wise and
columnar). Each parser either gives a sane result or raises its own error that says
what is wrong; nothing else escapes, whatever the input."""

from __future__ import annotations

import math
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from trainwarden.agent.drills import KINDS, DrillError, parse
from trainwarden.alerts import RuleError, parse_rule
from trainwarden.collector.ingest.schema_columns import ColumnarBatch
from trainwarden.collector.ingest.schemas import AgentInfo, IngestBatch

SETTINGS = settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

# -- the drill spec ------------------------------------------------------------------------

SPEC_CHARS = string.ascii_letters + string.digits + "=@,;.-_ xC"
numbers = st.one_of(
    st.integers(-5, 10**6).map(str), st.sampled_from(["", "-1", "1e400", "nan", "inf", "0", "007"])
)


@st.composite
def drill_parts(draw: Any) -> str:
    """Specs that look right, with numbers anywhere in their range (and past it)."""
    kind = draw(st.sampled_from(KINDS))
    value = {
        "xid": draw(numbers),
        "thermal": draw(numbers) + "C",
        "slow": draw(numbers) + "x",
        "loss_spike": draw(numbers) + "x",
    }.get(kind)
    params = [f"rank={draw(numbers)}"] if draw(st.booleans()) else []
    if draw(st.booleans()):
        params.append(f"step={draw(numbers)}")
    else:
        params.append(f"steps={draw(numbers)}-{draw(numbers)}")
    if draw(st.booleans()):
        params.append(f"for={draw(numbers)}s")
    return f"{kind}{'=' + value if value is not None else ''}@{','.join(params)}"


def _sane(fault: Any) -> None:
    assert fault.kind in KINDS
    assert fault.rank is None or fault.rank >= 0
    assert fault.first >= 0 and (fault.last is None or fault.last >= fault.first)
    assert fault.value is None or math.isfinite(fault.value)
    assert fault.kind not in ("slow", "loss_spike", "xid") or fault.value > 0
    assert fault.seconds is None or (math.isfinite(fault.seconds) and fault.seconds > 0)


@SETTINGS
@given(st.lists(drill_parts(), min_size=1, max_size=3).map(";".join))
def test_a_drill_spec_parses_to_sane_faults_or_says_what_is_wrong(spec: str) -> None:
    try:
        faults = parse(spec)
    except DrillError as exc:
        assert "drill " in str(exc) and "Form:" in str(exc)
        return
    assert len(faults) == spec.count(";") + 1
    for fault in faults:
        _sane(fault)


@SETTINGS
@given(st.text(alphabet=SPEC_CHARS, max_size=60))
def test_any_text_as_a_drill_spec_is_parsed_or_refused(spec: str) -> None:
    try:
        faults = parse(spec)
    except DrillError:
        return
    for fault in faults:
        _sane(fault)


# -- rules ---------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
RULE_KEYS = [
    "name",
    "kind",
    "summary",
    "params",
    "for",
    "keep_firing_for",
    "severity",
    "runbook",
    "action",
    "labels",
    "scope",
    "metric",
    "above",
    "below",
    "window",
]


@st.composite
def rule_like(draw: Any) -> dict[str, Any]:
    rule = {
        "name": draw(st.sampled_from(["X", "LossSpike", "", "a b"])),
        "kind": draw(
            st.sampled_from(["threshold", "baseline", "peer", "event", "absence", "rate", "nope"])
        ),
        "summary": "s",
        "severity": draw(st.sampled_from(["critical", "warning", "info", "loud"])),
        "runbook": draw(st.sampled_from(["LossSpike.md", "missing.md", ""])),
    }
    for key in draw(st.lists(st.sampled_from(RULE_KEYS), max_size=4)):
        rule[key] = draw(json_values)
    return rule


@SETTINGS
@given(st.one_of(rule_like(), json_values))
def test_a_rule_parses_or_is_refused_with_its_problems(raw: Any) -> None:
    try:
        rule = parse_rule(raw)
    except RuleError as exc:
        assert str(exc).strip()  # one line per problem, never empty
        return
    assert rule.name and rule.severity in ("critical", "warning", "info")


# -- ingest bodies -------------------------------------------------------------------------

finite = st.floats(0, 1e6, allow_nan=False)
step_rows = st.fixed_dictionaries(
    {"step": st.integers(0, 2**40), "ts": st.floats(1.6e9, 1.7e9), "duration_s": finite},
    optional={
        "loss": st.floats(allow_nan=True, allow_infinity=True)
        | st.sampled_from(["nan", "inf", "-inf"]),
        "tokens": st.integers(0, 2**40),
        "data_wait_s": finite,
        "mfu": st.floats(0, 1),
        "compute_s": finite,
        "exposed_comm_s": finite,
    },
)


def _agent(rank: int, world: int) -> dict[str, Any]:
    return {"rank": rank, "world_size": world, "host": "h", "session": f"s{rank}"}


@SETTINGS
@given(st.lists(step_rows, max_size=20), st.integers(0, 3))
def test_row_wise_and_columnar_bodies_agree(rows: list[dict[str, Any]], rank: int) -> None:
    row_wise = {"run": "r", "agent": _agent(rank, 4), "steps": rows}
    names = sorted({k for r in rows for k in r})
    columns = (
        {"rank": [rank] * len(rows), **{n: [r.get(n) for r in rows] for n in names}} if rows else {}
    )
    columnar = {
        "run": "r",
        "world_size": 4,
        "steps": columns,
        "agents": [{k: v for k, v in _agent(rank, 4).items() if k != "world_size"}],
    }
    a = IngestBatch.model_validate(row_wise)
    b = ColumnarBatch.model_validate(columnar)
    if not rows:
        assert b.rows() == []
        return
    by_rows = [s.model_dump(include=set(names)) for s in a.steps]
    by_cols = [{n: row.get(n) for n in names} for _, row in b.rows()]
    for x, y in zip(by_rows, by_cols, strict=True):
        assert x.keys() == y.keys()
        for n in names:
            same = x[n] == y[n] or (
                isinstance(x[n], float) and math.isnan(x[n]) and math.isnan(y[n])
            )
            assert same, (n, x[n], y[n])


opt_ts = st.none() | st.floats(allow_nan=True, allow_infinity=True) | st.floats(1.6e9, 1.7e9)
headers = st.fixed_dictionaries(
    {
        "rank": st.integers(0, 9),
        "host": st.sampled_from(["h", "node-7", ""]),
        "session": st.text(min_size=1, max_size=3),
    },
    optional={
        "local_rank": st.integers(-1, 8),
        "node": st.none() | st.sampled_from(["n1", "x" * 300]),
        "pid": st.none() | st.integers(-1, 2**31),
        "sent_at": opt_ts,
        "last_step_end": opt_ts,
        "started_at": opt_ts,
        "heartbeat_s": st.none() | st.floats(-1, 5000),
        "last_step": st.none() | st.integers(0, 2**40),
        "in_step": st.none() | st.booleans(),
        "phase": st.none() | st.sampled_from(["fwd", "p" * 40]),
    },
)


@SETTINGS
@given(st.lists(headers, min_size=1, max_size=6), st.integers(1, 10))
def test_headers_as_agents_and_as_agent_columns_agree(
    heads: list[dict[str, Any]], world: int
) -> None:
    # The same ranks' headers sent row-wise (agents, one AgentInfo each) and column-wise
    # (agent_columns): both accepted with the same header columns, or both refused.
    # Column-wise, a field is sent for every rank or for none (what a forwarder does).
    names = {k for h in heads for k in h}
    heads = [{k: h.get(k, AgentInfo.model_fields[k].default) for k in names} for h in heads]
    rows = {"run": "r", "world_size": world, "agents": heads}
    cols = {
        "run": "r",
        "world_size": world,
        "agent_columns": {k: [h[k] for h in heads] for k in names},
    }
    try:
        a = ColumnarBatch.model_validate(rows)
    except ValidationError:
        with pytest.raises(ValidationError):
            ColumnarBatch.model_validate(cols)
        return
    b = ColumnarBatch.model_validate(cols)
    x, y = a.header_columns(), b.header_columns()
    assert x.keys() == y.keys()
    for name in x:
        assert x[name] == y[name] or all(
            u == v or (isinstance(u, float) and math.isnan(u) and math.isnan(v))
            for u, v in zip(x[name], y[name], strict=True)
        ), (name, x[name], y[name])


@SETTINGS
@given(json_values, st.sampled_from([IngestBatch, ColumnarBatch]))
def test_any_json_body_is_accepted_or_refused_with_a_validation_error(
    body: Any, model: Any
) -> None:
    if isinstance(body, dict):
        body = {"run": "r", "agent": _agent(0, 1), **body} if model is IngestBatch else body
    try:
        model.model_validate(body)
    except ValidationError as exc:
        assert exc.errors()  # names the field(s)


@pytest.mark.parametrize(
    "bad",
    [
        {"ts": -1.0},
        {"ts": float("nan")},
        {"step": -1},
        {"step": 2**63},
        {"duration_s": float("inf")},
        {"duration_s": -0.5},
    ],
)
def test_a_bad_step_field_is_refused_naming_it(bad: dict[str, Any]) -> None:
    row = {"step": 1, "ts": 1.7e9, "duration_s": 0.1, **bad}
    with pytest.raises(ValidationError) as refused:
        IngestBatch.model_validate({"run": "r", "agent": _agent(0, 1), "steps": [row]})
    assert refused.value.errors()[0]["loc"][-1] == next(iter(bad))
