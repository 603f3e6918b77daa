"""Reading rule files: YAML in, checked rules out, or a :class:`RuleError` that says
which file, line, rule and field is wrong and why."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from .config_file import describe, field_path, read_yaml
from .rules import DEFAULT_RULES, KINDS, MATCHES, RUNBOOKS_DIR, Rule, RuleError, _FieldError


def _field_path(err: ErrorDetails, kind: str) -> list[str | int]:
    loc = list(err["loc"])
    # pydantic names the member of a tagged union in the path (params.xid.codes):
    # the user wrote params.codes, so drop the tag.
    at = {"event": 1, "rate": 2}.get(kind)
    if (
        at is not None
        and len(loc) > at
        and loc[at] in MATCHES
        and loc[at - 1] in ("params", "count")
    ):
        del loc[at]
    error = (err.get("ctx") or {}).get("error")
    if isinstance(error, _FieldError):
        loc.append(error.field)
    elif err["type"].startswith("union_tag"):
        loc.append("match")
    return loc


def _message(err: ErrorDetails) -> str:
    if err["type"] == "union_tag_invalid":
        tag = (err.get("ctx") or {}).get("tag")
        return f"{tag!r} is not a match; known: {', '.join(MATCHES)}"
    return describe(err)


def _problems(exc: ValidationError, kind: str) -> list[str]:
    errors = exc.errors()
    # A list whose items are wrong is also "too short" once they are dropped: say it once.
    itemized = {err["loc"][:-1] for err in errors if err["loc"] and isinstance(err["loc"][-1], int)}
    out = []
    for err in errors:
        if err["type"] == "too_short" and err["loc"] in itemized:
            continue
        path = field_path(_field_path(err, kind))
        out.append(f"{path}: {_message(err)}" if path else _message(err))
    return out


def parse_rule(raw: Any, *, runbooks_dirs: Sequence[Path] = (RUNBOOKS_DIR,)) -> Rule:
    """One rule from its mapping; raises :class:`RuleError` with one line per problem."""
    if not isinstance(raw, dict):
        raise RuleError(f"a rule is a mapping of fields, not {type(raw).__name__}")
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        said = "is required" if kind is None else f"{kind!r} is not a rule kind"
        raise RuleError(f"kind: {said}; known: {', '.join(KINDS)}")
    try:
        rule = KINDS[kind].model_validate(raw, context={"runbooks_dirs": list(runbooks_dirs)})
    except ValidationError as exc:
        raise RuleError("\n".join(_problems(exc, kind))) from None
    return rule  # type: ignore[return-value]  # KINDS holds exactly the members of Rule


def load_rules(
    path: Path | str, *, runbooks_dir: Path | str | Sequence[Path | str] = RUNBOOKS_DIR
) -> list[Rule]:
    """The rules in one file. Each rule's runbook must be a file in ``runbooks_dir`` (or
    in one of several directories). Raises :class:`RuleError` listing every problem."""
    path = Path(path)
    dirs = (
        [Path(runbooks_dir)]
        if isinstance(runbooks_dir, (str, Path))
        else [Path(d) for d in runbooks_dir]
    )
    doc = read_yaml(path, what="rules file", error=RuleError)
    if not isinstance(doc, dict) or set(doc) != {"rules"} or not isinstance(doc["rules"], list):
        raise RuleError(f"{path}: expected one key, 'rules', holding a list of rules")
    rules: list[Rule] = []
    problems: list[str] = []
    lines: dict[str, int] = {}
    for i, raw in enumerate(doc["rules"]):
        line = getattr(raw, "line", 0)
        name = raw.get("name") if isinstance(raw, dict) else None
        where = (f"{path}:{line}: " if line else f"{path}: ") + (
            f"rule {name!r}" if isinstance(name, str) else f"rule #{i + 1}"
        )
        try:
            rule = parse_rule(raw, runbooks_dirs=dirs)
        except RuleError as exc:
            problems.extend(f"{where}: {problem}" for problem in str(exc).splitlines())
            continue
        if rule.name in lines:
            problems.append(f"{where}: name: already used by the rule at line {lines[rule.name]}")
            continue
        lines[rule.name] = line
        rules.append(rule)
    if problems:
        raise RuleError("\n".join(problems))
    return rules


def load_rule_packs(
    paths: Iterable[Path | str] = (),
    *,
    default: bool = True,
    runbooks_dirs: Sequence[Path | str] = (),
) -> list[Rule]:
    """The default pack (unless ``default=False``) and then each file of ``paths``.
    Runbooks are looked up in ``runbooks_dirs``, then in the shipped ones. A rule name
    may be used once across all files."""
    files = ([DEFAULT_RULES] if default else []) + [Path(p) for p in paths]
    dirs = [Path(d) for d in runbooks_dirs] + [RUNBOOKS_DIR]
    rules: list[Rule] = []
    problems: list[str] = []
    origin: dict[str, Path] = {}
    for path in files:
        try:
            loaded = load_rules(path, runbooks_dir=dirs)
        except RuleError as exc:
            problems.append(str(exc))
            continue
        for rule in loaded:
            if rule.name in origin:
                problems.append(
                    f"{path}: rule {rule.name!r}: name: already defined in {origin[rule.name]}"
                )
            else:
                origin[rule.name] = path
                rules.append(rule)
    if problems:
        raise RuleError("\n".join(problems))
    return rules
