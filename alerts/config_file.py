"""Reading a YAML config file into strict pydantic models, for the alert rules
(``loading.py``), the notifiers (``collector/alerting/notify/config.py``) and the action policy
(``collector/actions/policy.py``): one safe loader whose mappings know their line and
refuse a repeated key, one strict model base, and one way of saying what is wrong: a
line per problem naming the file, the line where the YAML has one, and the field."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails

Loc = tuple[str | int, ...]
"""Where in a file: ``("receivers", 1, "url")``."""


class ConfigFileError(ValueError):
    """A config file that cannot be used: one line per problem, each naming the file (and
    line), what in it is wrong and why. Each kind of file has its own subclass."""


class StrictModel(BaseModel):
    """A config section: a key it does not define is an error, not ignored. (A subclass's
    own ``model_config`` adds to this one.)"""

    model_config = ConfigDict(extra="forbid")


class LineMapping(dict[str, Any]):
    """A YAML mapping that remembers the line it starts on and each key's (1-based)."""

    line = 0
    key_lines: dict[Any, int] = {}  # each mapping read sets its own


class Loader(yaml.SafeLoader):
    """Safe YAML (no arbitrary objects) whose mappings know their line and refuse a
    repeated key (plain YAML keeps the last one, so a second ``severity:`` would silently
    win)."""


def _construct_mapping(loader: Loader, node: yaml.MappingNode) -> LineMapping:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} repeats line {seen[key] + 1}", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    mapping = LineMapping(loader.construct_mapping(node, deep=True))
    mapping.line = node.start_mark.line + 1
    mapping.key_lines = {key: line + 1 for key, line in seen.items()}
    return mapping


Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(
    path: Path, *, what: str, error: type[ConfigFileError], text: str | None = None
) -> Any:
    """The YAML document in ``path`` (or ``text``, with ``path`` naming it), through
    :class:`Loader`. A file that cannot be read, or bad YAML, raises ``error`` naming
    the file, ``what`` it is, and the line and column of a syntax error."""
    if text is None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise error(f"{path}: cannot read the {what}: {exc.strerror}") from None
    try:
        return yaml.load(text, Loader=Loader)  # a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise error(f"{where}: YAML syntax error: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: YAML syntax error: {exc}") from None


def field_path(loc: Sequence[str | int]) -> str:
    """``receivers[1].url`` for ``("receivers", 1, "url")``."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def describe(err: ErrorDetails) -> str:
    """What a pydantic error says, in the words a config file's author reads."""
    ctx = err.get("ctx") or {}
    kind = err["type"]
    if kind in ("missing", "union_tag_not_found"):
        return "is required"
    if kind == "extra_forbidden":
        return "is not a field here (a typo?)"
    if kind == "value_error":
        return str(ctx["error"])
    if kind == "literal_error":
        return f"{err['input']!r} is not one of {ctx['expected']}"
    return f"{err['msg']} (got {err['input']!r})"


def line_of(doc: Any, loc: Loc) -> int:
    """The line of the innermost key (or list item's mapping) along ``loc`` in a
    document read by :class:`Loader` (0 when none is known)."""
    line, node = getattr(doc, "line", 0), doc
    for key in loc:
        try:
            child = node[key]
        except (KeyError, IndexError, TypeError):
            break
        line = getattr(node, "key_lines", {}).get(key) or getattr(child, "line", 0) or line
        node = child
    return line


def validate(model: type[BaseModel], path: Path, doc: Any, error: type[ConfigFileError]) -> Any:
    """``doc`` (read by :func:`read_yaml`) as ``model``; every problem on a line of its
    own: ``FILE:LINE: field.path: what is wrong``, raised as ``error``."""
    try:
        return model.model_validate({} if doc is None else doc)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            line = line_of(doc, tuple(err["loc"]))
            where = f"{path}:{line}" if line else str(path)
            fields = field_path(err["loc"])
            problems.append(f"{where}: {fields + ': ' if fields else ''}{describe(err)}")
        raise error("\n".join(problems)) from None
