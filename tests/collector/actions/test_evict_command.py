"""The command eviction backend against real scripts: its templates filled without a
shell, a failing or hanging command, and bad templates refused at load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainwarden.collector.actions.evict import CommandBackend, EvictError, Eviction, load_backend


def recorder(tmp_path: Path, body: str = "") -> Path:
    script = tmp_path / "evict.sh"
    script.write_text(
        f'#!/bin/sh\nprintf \'%s\\n\' "$@" > {tmp_path}/argv\necho "$TW_SITE" > {tmp_path}/env\n'
        + body
    )
    script.chmod(0o755)
    return script


def test_command_fills_the_templates_without_a_shell(tmp_path: Path) -> None:
    script = recorder(tmp_path, "echo drained $1\n")
    b = load_backend(
        {
            "backend": "command",
            "argv": [
                str(script),
                "{node}",
                "--reason={reason}",
                "{run}",
                "{job_id}",
                "{ranks}",
                "{{x}}",
            ],
            "env": {"TW_SITE": "lab"},
        }
    )
    e = Eviction(
        node="node2", reason="xid 79; $(touch pwned)", run="gpt-7b", job_id="12", ranks=(3, 5)
    )

    result = b.evict(e)

    assert (tmp_path / "argv").read_text().splitlines() == [
        "node2",
        "--reason=xid 79; $(touch pwned)",
        "gpt-7b",
        "12",
        "3,5",
        "{x}",
    ]
    assert not (tmp_path / "pwned").exists()
    assert (tmp_path / "env").read_text() == "lab\n"
    assert result.backend == "command"
    assert result.output == "drained node2"
    assert result.steps == (
        f"{script} node2 '--reason=xid 79; $(touch pwned)' gpt-7b 12 3,5 '{{x}}'",
    )


def test_command_unknown_job_id_is_an_empty_argument(tmp_path: Path) -> None:
    script = recorder(tmp_path)
    CommandBackend([str(script), "{job_id}", "{node}"]).evict(Eviction("n1", "r", "run"))
    assert (tmp_path / "argv").read_text().splitlines() == ["", "n1"]


def test_command_nonzero_exit_is_an_error_with_stderr(tmp_path: Path) -> None:
    script = recorder(tmp_path, "echo 'node n1 is not ours' >&2\nexit 3\n")
    with pytest.raises(EvictError, match=r"evict.sh n1` exited 3: node n1 is not ours$"):
        CommandBackend([str(script), "{node}"]).evict(Eviction("n1", "r", "run"))


def test_command_timeout_is_honoured(tmp_path: Path) -> None:
    script = recorder(tmp_path, f"sleep 30\ntouch {tmp_path}/returned\n")
    with pytest.raises(EvictError, match=r"timed out after 0.5 s"):
        CommandBackend([str(script)]).evict(Eviction("n1", "r", "run"), timeout_s=0.5)
    assert not (tmp_path / "returned").exists()  # it returned while the command still hung


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["evict", "{host}"], r"argv\[1\]: unknown placeholder \{host\}"),
        (["evict", "{node.name}"], r"argv\[1\]: unknown placeholder \{node.name\}"),
        (["evict", "{node:>9}"], r"argv\[1\]: \{node\} takes no format spec"),
        (["evict", "{node"], r"argv\[1\]: .*write \{\{ for a literal brace"),
        ("evict {node}", r"argv: must be a non-empty list"),
        ([], r"argv: must be a non-empty list"),
    ],
)
def test_command_bad_templates_are_rejected_at_load(argv: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_backend({"backend": "command", "argv": argv})
