"""Reading rule files: YAML in, checked rules out, or a :class:`RuleError` that says
which file, line, rule and field is wrong and why."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from .rules import DEFAULT_RULES, KINDS, MATCHES, RUNBOOKS_DIR, Rule, RuleError, _FieldError


class _Mapping(dict[str, Any]):
    """A YAML mapping that remembers its line."""

    line = 0


class _Loader(yaml.SafeLoader):
    """Safe YAML whose mappings know their line and refuse a repeated key (plain YAML
    keeps the last one, so a second ``severity:`` would silently win)."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> _Mapping:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} repeats line {seen[key] + 1}", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    mapping = _Mapping(loader.construct_mapping(node, deep=True))
    mapping.line = node.start_mark.line + 1
    return mapping


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


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
    ctx = err.get("ctx") or {}
    kind = err["type"]
    if kind == "missing" or kind == "union_tag_not_found":
        return "is required"
    if kind == "extra_forbidden":
        return "is not a field here (a typo?)"
    if kind == "value_error":
        return str(ctx["error"])
    if kind == "literal_error":
        return f"{err['input']!r} is not one of {ctx['expected']}"
    if kind == "union_tag_invalid":
        return f"{ctx['tag']!r} is not a match; known: {', '.join(MATCHES)}"
    return f"{err['msg']} (got {err['input']!r})"


def _problems(exc: ValidationError, kind: str) -> list[str]:
    errors = exc.errors()
    # A list whose items are wrong is also "too short" once they are dropped: say it once.
    itemized = {err["loc"][:-1] for err in errors if err["loc"] and isinstance(err["loc"][-1], int)}
    out = []
    for err in errors:
        if err["type"] == "too_short" and err["loc"] in itemized:
            continue
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in _field_path(err, kind))
        out.append(f"{path.lstrip('.')}: {_message(err)}" if path else _message(err))
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


def _read(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RuleError(f"{path}: cannot read the rules file: {exc.strerror}") from None
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader: no arbitrary objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise RuleError(f"{where}: YAML syntax error: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise RuleError(f"{path}: YAML syntax error: {exc}") from None


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
    doc = _read(path)
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
