"""The command backend: the operator's own script, with templated arguments."""

from __future__ import annotations

import shlex
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainwarden.collector.actions.evict.base import (
    PLACEHOLDERS,
    Clock,
    Eviction,
    EvictResult,
    run_command,
)


def check_template(template: str, allowed: Sequence[str], where: str) -> None:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"{where}: {exc} in {template!r} (write {{{{ for a literal brace)"
        ) from exc
    for _, field_name, spec, conversion in parsed:
        if field_name is None:
            continue
        if field_name not in allowed:
            raise ValueError(
                f"{where}: unknown placeholder {{{field_name}}} in {template!r}; "
                f"known: {', '.join('{' + p + '}' for p in allowed)}"
            )
        if spec or conversion:
            raise ValueError(f"{where}: {{{field_name}}} takes no format spec or conversion")


@dataclass
class CommandBackend:
    """Run the operator's script: ``argv`` items are templates over {node} {reason}
    {run} {job_id} {ranks} (job_id "" when unknown, ranks "3,5"). No shell: each item
    is one argument, whatever the values hold. Exit 0 is success; its stdout is kept."""

    argv: Sequence[str]
    env: Mapping[str, str] | None = None
    """Added to the collector's environment."""
    name = "command"

    def __post_init__(self) -> None:
        argv = self.argv
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(
                "argv: must be a non-empty list of strings (the program, then its "
                "arguments; no shell)"
            )
        for i, item in enumerate(argv):
            check_template(item, PLACEHOLDERS, f"argv[{i}]")
        self.argv = list(argv)

    def evict(self, e: Eviction, *, timeout_s: float = 30.0) -> EvictResult:
        clock = Clock(timeout_s)
        values = e.fields()
        argv = [item.format(**values) for item in self.argv]
        out = run_command(argv, clock=clock, steps=(), env=self.env)
        return EvictResult(self.name, e.node, (shlex.join(argv),), out.strip())
