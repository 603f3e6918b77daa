"""The rule model, the default pack and its runbooks, and what a broken rules file says."""

from __future__ import annotations

import inspect
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainwarden.agent import spikes
from trainwarden.agent.gpu import xid_catalog
from trainwarden.alerts import (
    DEFAULT_RULES,
    KINDS,
    RUNBOOKS_DIR,
    EventRule,
    Interval,
    RuleError,
    load_rule_packs,
    load_rules,
    parse_interval,
    parse_rule,
)
from trainwarden.alerts import rules as r
from trainwarden.collector.health import evaluator as health
from trainwarden.collector.health.settings import HealthSettings

PACK = [
    "LowMFU",
    "StepTimeRegression",
    "Straggler",
    "HighExposedComm",
    "DataLoaderStall",
    "LossSpike",
    "NonFiniteLoss",
    "ResumedFromSuspectCheckpoint",
    "CrashLoop",
    "RepeatOffenderNode",
    "PreflightFailed",
    "GradNormSpikeBurst",
    "RankLossDivergence",
    "GpuThermalThrottle",
    "GpuOverTemperature",
    "FatalXid",
    "EccUncorrectable",
    "RankHung",
    "RankDead",
    "CheckpointStale",
    "LowGpuUtilization",
    "ActionFailed",  # trainwarden's own: an action it took failed (issue 7)
    "CheckpointCadence",  # the cadence advisor's (issue 11)
    "SilentDataCorruption",  # replica fingerprints that disagree (issue 34)
    "DuplicateBatchAcrossRanks",  # one batch on several ranks of a data-parallel group (issue 35)
    "DataOrderDrift",  # a replayed step on other samples than its first execution (issue 35)
    "EpochCoverage",  # an epoch's samples counted (issue 35)
    "DataDuplicated",  # an epoch's samples repeated past the allowance (issue 35)
    "DataSkipped",  # an epoch's samples never seen past the allowance (issue 35)
    "DataMixtureDrift",  # a source's share off the declared mixture (issue 35)
    "DuplicateRank",  # two live processes claim one rank: a double launch (issue 53)
    "JobLostInCollective",  # a hung or desynced job that dies: one page naming its culprit
]
HEADINGS = [
    "## What it means",
    "## Likely causes",
    "## Diagnose",
    "## What trainwarden does",
    "## What to do",
    "## Escalate",
]


def _write(tmp_path: Path, text: str, name: str = "rules.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _rule(**fields: Any) -> dict[str, Any]:
    """A valid threshold rule with ``fields`` replaced."""
    base: dict[str, Any] = {
        "name": "HotGpu",
        "kind": "threshold",
        "summary": "A GPU is hot.",
        "severity": "warning",
        "runbook": "GpuOverTemperature.md",
        "params": {"scope": "gpu", "metric": "temp_c", "above": 80},
    }
    return base | fields


def _error(raw: dict[str, Any]) -> str:
    with pytest.raises(RuleError) as caught:
        parse_rule(raw)
    return str(caught.value)


# -- the default pack ---------------------------------------------------------------


def test_default_pack_loads_with_exactly_the_issue_rules() -> None:
    rules = load_rule_packs()
    assert sorted(rule.name for rule in rules) == sorted(PACK)
    by_name = {rule.name: rule for rule in rules}
    assert {n for n, rule in by_name.items() if rule.action == "rollback"} == {
        "LossSpike",
        "NonFiniteLoss",
        "ResumedFromSuspectCheckpoint",
    }
    assert {n for n, rule in by_name.items() if rule.action == "evict"} == {
        "FatalXid",
        "EccUncorrectable",
        "PreflightFailed",
    }
    assert {rule.kind for rule in rules} == set(KINDS)  # the pack uses every kind


def test_the_docs_say_how_many_rules_the_pack_ships_and_list_each() -> None:
    said = (Path(__file__).resolve().parents[2] / "docs" / "alerts.md").read_text()
    count = re.search(r"`alerts/rules/default\.yaml` ships (\d+)", said)
    assert count is not None, "docs/alerts.md no longer says how many rules ship"
    assert int(count.group(1)) == len(load_rule_packs())
    rows = {line.split("|")[1].strip() for line in said.splitlines() if line.startswith("| ")}
    missing = sorted(rule.name for rule in load_rule_packs() if rule.name not in rows)
    assert not missing, f"docs/alerts.md's table of the pack lacks {missing}"


def test_default_thresholds_are_the_ones_documented() -> None:
    by_name = {rule.name: rule for rule in load_rule_packs()}
    step = by_name["StepTimeRegression"].params
    assert (step.ratio_above, step.window) == (1.2, Interval(50, "steps"))
    assert by_name["HighExposedComm"].params.above == 0.25
    low = by_name["LowGpuUtilization"]
    assert (low.params.below, low.for_) == (50, parse_interval("10m"))
    # the same thresholds as the health evaluator that already watches these signals
    settings = HealthSettings()
    assert by_name["Straggler"].params.ratio_above == settings.straggler_ratio
    assert by_name["RankLossDivergence"].params.z_above == settings.divergence_z
    assert by_name["RankDead"].params.after == Interval(settings.dead_after_beats, "beats")


def test_fatal_xid_follows_the_catalog_actions() -> None:
    fatal = next(rule for rule in load_rule_packs() if rule.name == "FatalXid")
    assert isinstance(fatal, EventRule)
    for code, entry in xid_catalog().items():
        assert fatal.params.matches(code) == (
            entry["action"] in ("reset_gpu", "reboot_node", "drain")
        ), code
    assert fatal.params.matches(79) and fatal.params.matches(48)
    assert not fatal.params.matches(13)  # an application fault: restart the app, not the node


def test_every_rule_has_a_runbook_and_every_runbook_a_rule() -> None:
    named = {rule.runbook for rule in load_rule_packs()}
    files = {path.name for path in RUNBOOKS_DIR.glob("*.md")}
    assert named == files
    assert {f"{name}.md" for name in PACK} == files


@pytest.mark.parametrize("name", PACK)
def test_runbooks_share_one_structure(name: str) -> None:
    text = (RUNBOOKS_DIR / f"{name}.md").read_text()
    assert text.startswith(f"# {name}\n")
    positions = [text.find(heading + "\n") for heading in HEADINGS]
    assert all(p > 0 for p in positions), f"{name}.md misses a heading of {HEADINGS}"
    assert positions == sorted(positions), f"{name}.md has its headings out of order"
    diagnose = text[positions[2] : positions[3]]
    assert "```bash" in diagnose, f"{name}.md: the diagnosis needs exact commands"
    rule = next(rule for rule in load_rule_packs() if rule.name == name)
    assert f"**Action** {rule.action}" in text and f"**Severity** {rule.severity}" in text


def test_default_pack_is_commented() -> None:
    text = DEFAULT_RULES.read_text()
    for name in PACK:
        block = text.split(f"- name: {name}\n", 1)[1].split("\n  - name:", 1)[0]
        assert "#" in block, f"{name}: say why its threshold is what it is"


def test_vocabulary_matches_the_agent_and_the_collector() -> None:
    source = inspect.getsource(spikes)
    assert all(f'"{flag}"' in source for flag in r.FLAGS)
    assert {"healthy", "slow", "hung", "dead"} <= set(r.RANK_STATES)
    assert set(health.LIVE) - {"running"} <= set(r.RANK_STATES)
    assert {"temp_c", "util_gpu", "ecc_uncorrected"} <= set(r.GPU_METRICS)
    assert not {"run_id", "rank", "ts", "recv_ts", "simulated"} & set(r.GPU_METRICS)


# -- intervals ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", Interval(90, "s")),
        ("5m", Interval(300, "s")),
        ("1h", Interval(3600, "s")),
        ("1.5h", Interval(5400, "s")),
        ("50 steps", Interval(50, "steps")),
        ("1 step", Interval(1, "steps")),
        (0, Interval(0, "s")),
    ],
)
def test_intervals_parse(text: object, expected: Interval) -> None:
    assert parse_interval(text) == expected


@pytest.mark.parametrize("text", ["5 parsecs", "5", 5, "-1m", "2.5 steps", "3 beats", True, None])
def test_bad_intervals_say_what_is_expected(text: object) -> None:
    with pytest.raises(
        ValueError, match=r"is not a duration \('90s', '5m', '1h'\) or a step count \('50 steps'\)"
    ):
        parse_interval(text)


def test_intervals_print_back_in_their_largest_unit() -> None:
    assert [str(parse_interval(t)) for t in ("90s", "15m", "2h", "20 steps")] == [
        "90s",
        "15m",
        "2h",
        "20 steps",
    ]


# -- every kind's parameters --------------------------------------------------------

GOOD = [
    {
        "kind": "threshold",
        "params": {"scope": "run", "metric": "step_time", "stat": "max", "above": 2},
    },
    {
        "kind": "threshold",
        "params": {"scope": "rank", "metric": "data_wait", "fraction_of_step": True, "above": 0.5},
    },
    {
        "kind": "baseline",
        "params": {"scope": "rank", "metric": "compute", "ratio_above": 1.5, "baseline": "30m"},
    },
    {"kind": "peer", "params": {"metric": "tokens_per_s", "ratio_below": 0.7}},
    {"kind": "event", "params": {"match": "xid", "codes": [79, 94]}},
    {"kind": "event", "params": {"match": "flag", "flags": ["skip_suggested"]}},
    {"kind": "event", "params": {"match": "nonfinite", "metrics": ["grad_norm"]}},
    {"kind": "event", "params": {"match": "rank_state", "to": ["dead", "failed"]}, "for": "30s"},
    {"kind": "event", "params": {"match": "throttle", "reasons": ["power_brake"]}},
    {"kind": "event", "params": {"match": "event", "events": ["restart"]}},
    {"kind": "absence", "params": {"signal": "progress", "after": "5 steps", "at_least": "1m"}},
    {"kind": "absence", "params": {"signal": "heartbeat", "after": "30s"}},
    {
        "kind": "rate",
        "params": {
            "count": {"match": "event", "events": ["restart"]},
            "window": "1h",
            "at_least": 3,
            "per": "rank",
        },
    },
]


@pytest.mark.parametrize(
    "fields", GOOD, ids=lambda f: f"{f['kind']}-{next(iter(f['params'].values()))}"
)
def test_each_kind_accepts_its_parameters(fields: dict[str, Any]) -> None:
    rule = parse_rule(_rule(**fields))
    assert isinstance(rule, KINDS[fields["kind"]])
    # typed, not a raw dict, and holding exactly what was given (defaults left out)
    assert rule.params.model_dump(exclude_defaults=True, mode="json") == fields["params"]


def test_a_run_metric_defaults_to_its_run_level_total() -> None:
    rule = parse_rule(_rule(params={"scope": "run", "metric": "mfu", "below": 0.3}))
    assert rule.params.stat == "total"


BAD = [
    # (rule fields, the field named, words of the message)
    (
        {"params": {"scope": "run", "metric": "mfuu", "below": 1}},
        "params.metric",
        "'mfuu' is not a run metric trainwarden stores",
    ),
    (
        {"params": {"scope": "gpu", "metric": "mfu", "below": 1}},
        "params.metric",
        "'mfu' is not a gpu metric",
    ),
    (
        {"params": {"scope": "gpu", "metric": "temp_c"}},
        "params",
        "give exactly one of above, below",
    ),
    (
        {"params": {"scope": "gpu", "metric": "temp_c", "above": 1, "stat": "max"}},
        "params.stat",
        "only run metrics",
    ),
    (
        {"params": {"scope": "gpu", "metric": "temp_c", "above": 1, "window": "5 steps"}},
        "params.window",
        "use a duration",
    ),
    (
        {"params": {"scope": "rank", "metric": "loss", "above": 1, "fraction_of_step": True}},
        "params.fraction_of_step",
        "in seconds",
    ),
    (
        {"params": {"scope": "gpu", "metric": "temp_c", "above": 1, "colour": "red"}},
        "params.colour",
        "not a field here",
    ),
    (
        {"kind": "baseline", "params": {"scope": "run", "metric": "mfu", "ratio_below": 1.2}},
        "params.ratio_below",
        "less than 1",
    ),
    (
        {"kind": "baseline", "params": {"scope": "gpu", "metric": "temp_c", "ratio_above": 2}},
        "params.scope",
        "'run' or 'rank'",
    ),
    (
        {"kind": "peer", "params": {"metric": "loss", "z_above": 4, "min_ranks": 2}},
        "params.min_ranks",
        "at least 3 ranks",
    ),
    (
        {
            "kind": "peer",
            "params": {"metric": "loss", "z_above": 4, "ratio_above": 2, "min_ranks": 3},
        },
        "params",
        "exactly one",
    ),
    ({"kind": "event", "params": {"match": "xidd"}}, "params.match", "'xidd' is not a match"),
    ({"kind": "event", "params": {"codes": [79]}}, "params.match", "is required"),
    ({"kind": "event", "params": {"match": "xid"}}, "params", "give codes, actions"),
    (
        {"kind": "event", "params": {"match": "xid", "codes": [0]}},
        "params.codes[0]",
        "greater than or equal to 1",
    ),
    (
        {"kind": "event", "params": {"match": "flag", "flags": ["bogus"]}},
        "params.flags[0]",
        "'bogus' is not one of",
    ),
    (
        {"kind": "event", "params": {"match": "nonfinite", "metrics": ["tokens_per_s"]}},
        "params.metrics",
        "stored from one column",
    ),
    (
        {"kind": "event", "params": {"match": "rank_state", "to": ["asleep"]}},
        "params.to[0]",
        "'asleep' is not one of",
    ),
    (
        {"kind": "event", "params": {"match": "throttle", "reasons": ["hot"]}},
        "params.reasons[0]",
        "'hot' is not one of",
    ),
    ({"kind": "event", "params": {"match": "xid", "codes": [79]}, "for": "1m"}, "for", "instants"),
    (
        {"kind": "event", "params": {"match": "rank_state", "to": ["hung"]}, "for": "5 steps"},
        "for",
        "counts time, not steps",
    ),
    (
        {"kind": "absence", "params": {"signal": "event", "after": "1h"}},
        "params.event",
        "exactly when signal is 'event'",
    ),
    (
        {"kind": "absence", "params": {"signal": "progress", "after": "3 beats"}},
        "params.after",
        "does not measure a missing progress",
    ),
    (
        {"kind": "absence", "params": {"signal": "heartbeat", "after": "10s", "at_least": "1m"}},
        "params.at_least",
        "relative",
    ),
    (
        {
            "kind": "rate",
            "params": {
                "count": {"match": "flag", "flags": []},
                "window": "10 steps",
                "at_least": 1,
            },
        },
        "params.count.flags",
        "at least 1 item",
    ),
    (
        {
            "kind": "rate",
            "params": {
                "count": {"match": "flag", "flags": ["loss_spike"]},
                "window": "10 steps",
                "at_least": 0,
            },
        },
        "params.at_least",
        "greater than or equal to 1",
    ),
    ({"kind": "thresold"}, "kind", "'thresold' is not a rule kind; known: threshold, baseline"),
    ({"severity": "urgent"}, "severity", "'urgent' is not one of 'critical', 'warning' or 'info'"),
    (
        {"for": "5 parsecs"},
        "for",
        "'5 parsecs' is not a duration ('90s', '5m', '1h') or a step count ('50 steps')",
    ),
    ({"for": "5 steps"}, "for", "counts time, not steps"),
    ({"runbook": "Missing.md"}, "runbook", "'Missing.md' is not in"),
    ({"runbook": "../../etc/passwd"}, "runbook", "not a Markdown file name"),
    ({"action": "reboot"}, "action", "'reboot' is not one of"),
    (
        {"action": "evict", "params": {"scope": "run", "metric": "mfu", "below": 0.3}},
        "action",
        "evict needs a rule whose alerts name a rank",
    ),
    ({"labels": {"rank": "0"}}, "labels", "set by trainwarden"),
    ({"labels": {"bad-name": "x"}}, "labels", "not a label name"),
    ({"name": "Has space"}, "name", "use letters, digits and _"),
    ({"summary": ""}, "summary", "at least 1 character"),
]


@pytest.mark.parametrize(
    ("fields", "field", "words"), BAD, ids=[f"{b[1]}:{b[2][:24]}" for b in BAD]
)
def test_bad_rules_name_the_field_and_the_problem(
    fields: dict[str, Any], field: str, words: str
) -> None:
    lines = _error(_rule(**fields)).splitlines()
    assert any(line.startswith(f"{field}: ") and words in line for line in lines), lines


def test_a_missing_field_is_named() -> None:
    raw = _rule()
    del raw["severity"]
    assert _error(raw) == "severity: is required"


# -- files ----------------------------------------------------------------------------


def test_errors_name_the_file_the_line_the_rule_and_the_field(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """\
        rules:
          - name: LowMFU
            kind: baseline
            summary: MFU fell.
            params: {scope: run, metric: mfu, ratio_below: 0.8}
            for: 5 parsecs
            severity: warning
            runbook: LowMFU.md
          - name: Fine
            kind: event
            summary: ok
            params: {match: xid, actions: [drain]}
            severity: critical
            runbook: FatalXid.md
          - name: Nameless
            kind: peer
            summary: a metric trainwarden does not store
            params: {metric: perplexity, ratio_above: 2}
            severity: info
            runbook: NoSuchRunbook.md
    """,
    )
    with pytest.raises(RuleError) as caught:
        load_rules(path)
    assert str(caught.value).splitlines() == [
        f"{path}:2: rule 'LowMFU': for: '5 parsecs' is not a duration ('90s', '5m', '1h') "
        "or a step count ('50 steps')",
        f"{path}:15: rule 'Nameless': runbook: 'NoSuchRunbook.md' is not in {RUNBOOKS_DIR}",
        f"{path}:15: rule 'Nameless': params.metric: 'perplexity' is not a rank metric "
        f"trainwarden stores; known: {', '.join(r.STEP_METRICS)}",
    ]


def test_yaml_syntax_errors_give_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "rules:\n  - name: A\n    kind: event\n   severity: x\n")
    with pytest.raises(RuleError, match=re.escape(f"{path}:4:") + r"\d+: YAML syntax error: "):
        load_rules(path)


def test_a_repeated_key_is_an_error_not_a_silent_override(tmp_path: Path) -> None:
    path = _write(tmp_path, "rules:\n  - name: A\n    severity: info\n    severity: critical\n")
    with pytest.raises(
        RuleError, match=re.escape(f"{path}:4:5: YAML syntax error: key 'severity' repeats line 3")
    ):
        load_rules(path)


@pytest.mark.parametrize("text", ["", "- name: A\n", "rules: {}\n", "rules: []\nextra: 1\n"])
def test_the_file_must_hold_a_list_of_rules(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(
        RuleError, match=re.escape(f"{path}: expected one key, 'rules', holding a list of rules")
    ):
        load_rules(path)


def test_a_rule_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = _write(tmp_path, "rules:\n  - just a string\n")
    with pytest.raises(
        RuleError, match=re.escape(f"{path}: rule #1: a rule is a mapping of fields, not str")
    ):
        load_rules(path)


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RuleError, match="nope.yaml: cannot read the rules file"):
        load_rules(tmp_path / "nope.yaml")


def _rules_file(tmp_path: Path, name: str, *rules: dict[str, Any]) -> Path:
    return _write(tmp_path, yaml.safe_dump({"rules": list(rules)}), name)


def test_duplicate_names_are_rejected_within_a_file(tmp_path: Path) -> None:
    path = _rules_file(tmp_path, "rules.yaml", _rule(), _rule())
    with pytest.raises(
        RuleError,
        match=re.escape(f"{path}:")
        + r"\d+: rule 'HotGpu': name: already used by the rule at line \d+",
    ):
        load_rules(path)


def test_user_files_add_to_the_default_pack_and_cannot_reuse_its_names(tmp_path: Path) -> None:
    mine = _rules_file(tmp_path, "mine.yaml", _rule())
    names = [rule.name for rule in load_rule_packs([mine])]
    assert names[-1] == "HotGpu" and len(names) == len(PACK) + 1
    clash = _rules_file(tmp_path, "clash.yaml", _rule(name="LowMFU"))
    with pytest.raises(
        RuleError,
        match=re.escape(f"{clash}: rule 'LowMFU': name: already defined in {DEFAULT_RULES}"),
    ):
        load_rule_packs([clash])


def test_user_runbooks_come_from_their_own_folder(tmp_path: Path) -> None:
    books = tmp_path / "books"
    books.mkdir()
    (books / "HotGpu.md").write_text("# HotGpu\n")
    mine = _rules_file(tmp_path, "mine.yaml", _rule(runbook="HotGpu.md"))
    with pytest.raises(RuleError, match="runbook: 'HotGpu.md' is not in"):
        load_rule_packs([mine])
    assert load_rule_packs([mine], runbooks_dirs=[books])[-1].runbook == "HotGpu.md"
    assert load_rules(mine, runbooks_dir=books)[0].name == "HotGpu"


def test_all_problems_of_several_files_are_reported_at_once(tmp_path: Path) -> None:
    one = _rules_file(tmp_path, "one.yaml", _rule(severity="urgent"))
    two = _rules_file(tmp_path, "two.yaml", _rule(name="Other", runbook="Missing.md"))
    with pytest.raises(RuleError) as caught:
        load_rule_packs([one, two])
    message = str(caught.value)
    assert "one.yaml" in message and "severity:" in message
    assert "two.yaml" in message and "runbook:" in message


def test_rules_are_frozen_data() -> None:
    rule = parse_rule(_rule())
    with pytest.raises(ValueError):
        rule.severity = "critical"  # type: ignore[misc]
    assert parse_rule(rule.model_dump(by_alias=True)) == rule  # round-trips through plain data


def test_the_gpu_metrics_rules_may_name_are_the_numeric_readings_the_collector_stores() -> None:
    from sqlalchemy import Float, Integer

    from trainwarden.alerts.rules import GPU_METRICS
    from trainwarden.collector.store import models

    stored = tuple(
        c.name
        for c in models.gpu_samples.columns
        if isinstance(c.type, (Float, Integer))
        and not c.primary_key  # run, rank, time: the keys, not readings
        and c.name not in ("recv_ts", "simulated")
    )
    assert stored == GPU_METRICS
