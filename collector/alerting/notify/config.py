"""The notifier config file (docs/notifiers.md): receivers and the routes that pick them
by a notification's labels, read and checked as every config file is
(``alerts/config_file.py``); ``${VAR}`` in a value comes from the environment."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from trainwarden.alerts.config_file import (
    ConfigFileError,
    Loc,
    StrictModel,
    describe,
    field_path,
    read_yaml,
)
from trainwarden.alerts.notification import Notification

from .receivers import (
    KIND_NAMES,
    PAGERDUTY_URL,
    RESEND_VALIDITY_S,
    AlertmanagerNotifier,
    Notifier,
    PagerDutyNotifier,
    SlackNotifier,
    WebhookNotifier,
)

# -- configuration ----------------------------------------------------------------------


class NotifyConfigError(ConfigFileError):
    """A notifier config that cannot be used; one line per problem, each naming the file,
    the receiver or route, and the field."""


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_LABEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class _Strict(StrictModel):
    model_config = ConfigDict(frozen=True)


def _http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http:// or https:// URL with a host")
    return value


class _Receiver(_Strict):
    name: str
    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    send_resolved: bool | None = None
    """Default: the file's ``send_resolved``."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError(f"{value!r}: use letters, digits, '_', '.' and '-' (64 at most)")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _http_url(value)


class _AlertmanagerSpec(_Receiver):
    kind: Literal["alertmanager"]
    resend_validity_s: float = Field(default=RESEND_VALIDITY_S, gt=0)


class _PagerDutySpec(_Receiver):
    kind: Literal["pagerduty"]
    routing_key: str = Field(min_length=1)
    url: str = PAGERDUTY_URL


class _SlackSpec(_Receiver):
    kind: Literal["slack"]


class _WebhookSpec(_Receiver):
    kind: Literal["webhook"]
    external_url: str = ""


_Spec = Annotated[
    Union[_AlertmanagerSpec, _PagerDutySpec, _SlackSpec, _WebhookSpec],  # noqa: UP007  # pydantic needs the Union of a discriminated union on 3.10
    Field(discriminator="kind"),
]


class _RouteSpec(_Strict):
    model_config = ConfigDict(coerce_numbers_to_str=True)

    match: dict[str, str] = Field(default_factory=dict)
    match_re: dict[str, str] = Field(default_factory=dict)
    receivers: list[str] = Field(min_length=1)
    continue_: bool = Field(default=True, alias="continue")

    @field_validator("match", "match_re")
    @classmethod
    def _label_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _LABEL.fullmatch(key):
                raise ValueError(f"{key!r} is not a label name (letters, digits, _)")
        return value

    @field_validator("match_re")
    @classmethod
    def _regexes(cls, value: dict[str, str]) -> dict[str, str]:
        for key, pattern in value.items():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{key}: {pattern!r} is not a regular expression: {exc}") from None
        return value


class _File(_Strict):
    receivers: list[_Spec] = Field(min_length=1)
    routes: list[_RouteSpec] = Field(min_length=1)
    send_resolved: bool = True


@dataclass(frozen=True)
class Route:
    """Receivers for the notifications whose labels match: ``match`` exactly, ``match_re``
    as full-match regexes (a missing label is the empty string, as in Alertmanager)."""

    receivers: tuple[str, ...]
    match: dict[str, str] = field(default_factory=dict)
    match_re: dict[str, re.Pattern[str]] = field(default_factory=dict)
    continue_: bool = True
    """Also try the routes after this one when it matches."""

    def matches(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k, "") == v for k, v in self.match.items()) and all(
            p.fullmatch(labels.get(k, "")) for k, p in self.match_re.items()
        )


@dataclass(frozen=True)
class NotifyConfig:
    receivers: dict[str, Notifier]
    routes: list[Route]
    no_resolved: frozenset[str] = frozenset()
    """Receivers with ``send_resolved: false``: told when alerts fire, not when they end."""

    def receivers_for(self, n: Notification) -> list[Notifier]:
        """Every matching route's receivers, each once, up to a match with ``continue: false``."""
        names: dict[str, None] = {}
        for route in self.routes:
            if route.matches(n.labels):
                names.update(dict.fromkeys(route.receivers))
                if not route.continue_:
                    break
        if n.status == "resolved":
            return [self.receivers[x] for x in names if x not in self.no_resolved]
        return [self.receivers[x] for x in names]


def _walk(node: Any, at: Loc = ()) -> Iterator[tuple[Loc, Any, str | int, str]]:
    """(where, container, key, string) for every string value in a YAML tree."""
    if isinstance(node, dict):
        items: Iterable[tuple[Any, Any]] = node.items()
    else:
        items = enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if isinstance(value, str):
            yield (*at, key), node, key, value
        else:
            yield from _walk(value, (*at, key))


def _expand_env(doc: Any) -> list[tuple[Loc, str]]:
    """Replace ``${VAR}`` in string values, in place; the (path, problem) of each unset one."""
    problems = []
    for path, parent, key, value in list(_walk(doc)):
        missing = [m for m in _ENV.findall(value) if m not in os.environ]
        for var in missing:
            problems.append((path, f"${{{var}}}: the environment variable {var} is not set"))
        if not missing:
            parent[key] = _ENV.sub(lambda m: os.environ[m.group(1)], value)
    return problems


def _where(path: Path, doc: Any, loc: Loc) -> str:
    """``notify.yaml:12: receiver 'pd'`` or ``notify.yaml:20: route #2`` for a location."""
    if len(loc) >= 2 and loc[0] in ("receivers", "routes") and isinstance(loc[1], int):
        items = doc.get(loc[0]) if isinstance(doc, dict) else None
        raw = items[loc[1]] if isinstance(items, list) and loc[1] < len(items) else None
        line = getattr(raw, "line", 0)
        at = f"{path}:{line}" if line else str(path)
        if loc[0] == "routes":
            return f"{at}: route #{loc[1] + 1}"
        name = raw.get("name") if isinstance(raw, dict) else None
        return (
            f"{at}: receiver {name!r}" if isinstance(name, str) else f"{at}: receiver #{loc[1] + 1}"
        )
    return str(path)


def _problem(path: Path, doc: Any, loc: Loc, message: str) -> str:
    inner = loc[2:] if len(loc) >= 2 and isinstance(loc[1], int) else loc
    fields = field_path(inner)
    return f"{_where(path, doc, loc)}: {fields + ': ' if fields else ''}{message}"


def _pydantic_problem(err: ErrorDetails) -> tuple[Loc, str]:
    loc = list(err["loc"])
    if len(loc) >= 3 and loc[0] == "receivers" and loc[2] in KIND_NAMES:
        del loc[2]  # the member of the tagged union: the user wrote no such key
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind.startswith("union_tag"):
        loc.append("kind")
        given = ctx.get("tag")
        said = "is required" if given is None else f"{given!r} is not a kind"
        return tuple(loc), f"{said}; known: {', '.join(KIND_NAMES)}"
    return tuple(loc), describe(err)


def load_notify_config(path: Path | str, *, text: str | None = None) -> NotifyConfig:
    """The receivers and routes of a YAML file (or of ``text``, with ``path`` naming it in
    errors). ``${VAR}`` in a value comes from the environment. Raises
    :class:`NotifyConfigError` listing every problem."""
    path = Path(path)
    doc = read_yaml(path, what="notifier config", error=NotifyConfigError, text=text)
    if not isinstance(doc, dict):
        raise NotifyConfigError(f"{path}: expected a mapping with 'receivers' and 'routes'")
    problems = [_problem(path, doc, loc, msg) for loc, msg in _expand_env(doc)]
    try:
        spec = _File.model_validate(doc)
    except ValidationError as exc:
        found = [_pydantic_problem(err) for err in exc.errors()]
        raise NotifyConfigError(
            "\n".join(problems + [_problem(path, doc, *f) for f in found])
        ) from None
    first: dict[str, int] = {}
    for i, r in enumerate(spec.receivers):
        if r.name in first:
            problems.append(
                _problem(
                    path,
                    doc,
                    ("receivers", i, "name"),
                    f"already used by receiver #{first[r.name] + 1}",
                )
            )
        first.setdefault(r.name, i)
    for i, route in enumerate(spec.routes):
        for j, name in enumerate(route.receivers):
            if name not in first:
                problems.append(
                    _problem(
                        path,
                        doc,
                        ("routes", i, "receivers", j),
                        f"{name!r} is not a receiver; known: {', '.join(first)}",
                    )
                )
    if problems:
        raise NotifyConfigError("\n".join(problems))
    routes = [
        Route(
            tuple(r.receivers),
            dict(r.match),
            {k: re.compile(v) for k, v in r.match_re.items()},
            r.continue_,
        )
        for r in spec.routes
    ]
    quiet = [r.name for r in spec.receivers if not _default(r.send_resolved, spec.send_resolved)]
    return NotifyConfig({r.name: _notifier(r) for r in spec.receivers}, routes, frozenset(quiet))


def _default(value: bool | None, default: bool) -> bool:
    return default if value is None else value


def _notifier(r: _Receiver) -> Notifier:
    name, url, headers = r.name, r.url, dict(r.headers)
    if isinstance(r, _AlertmanagerSpec):
        return AlertmanagerNotifier(name, url, headers, resend_validity_s=r.resend_validity_s)
    if isinstance(r, _PagerDutySpec):
        return PagerDutyNotifier(name, url, headers, routing_key=r.routing_key)
    if isinstance(r, _WebhookSpec):
        return WebhookNotifier(name, url, headers, external_url=r.external_url)
    return SlackNotifier(name, url, headers)
