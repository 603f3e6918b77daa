"""The one way trainwarden reads its YAML config files (``alerts/config_file.py``): the
rules, the notifiers and the action policy each say what is wrong with the file, the
line and the field, refuse a repeated key, and are one kind of error."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainwarden.alerts import RuleError, load_rules
from trainwarden.alerts.config_file import ConfigFileError
from trainwarden.collector.actions.policy import ActionConfigError, load_policy
from trainwarden.collector.alerting.notify import NotifyConfigError, load_notify_config


def test_an_action_policy_s_problems_each_name_the_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "actions.yaml"
    path.write_text(
        "rollback:\n"
        "  mode: sometimes\n"
        "  margin_steps: -1\n"
        "evict:\n"
        "  cooldown: 5 parsecs\n"
        "stop:\n"
        "  prepare_timeout: 3s\n"
        "  pepare_timeout: 3s\n"
    )
    with pytest.raises(ActionConfigError) as caught:
        load_policy(path)
    assert str(caught.value).splitlines() == [
        f"{path}:2: rollback.mode: 'sometimes' is not one of 'auto', 'require-ack' or 'dry-run'",
        f"{path}:3: rollback.margin_steps: Input should be greater than or equal to 0 (got -1)",
        f"{path}:5: evict.cooldown: '5 parsecs' is not a duration ('90s', '5m', '1h')",
        f"{path}:8: stop.pepare_timeout: is not a field here (a typo?)",
    ]


def test_an_action_policy_that_is_fine_or_empty_loads(tmp_path: Path) -> None:
    path = tmp_path / "actions.yaml"
    path.write_text("rollback:\n  mode: auto\n  prepare_timeout: 20s\nstop:\n  mode: auto\n")
    policy = load_policy(path)
    assert (policy.rollback.mode, policy.rollback.prepare_timeout.seconds) == ("auto", 20.0)
    assert (policy.evict.mode, policy.stop.mode) == ("dry-run", "auto")
    path.write_text("")
    assert load_policy(path) == load_policy(None)


@pytest.mark.parametrize(
    "load, error, what",
    [
        (load_rules, RuleError, "rules file"),
        (load_notify_config, NotifyConfigError, "notifier config"),
        (load_policy, ActionConfigError, "action policy"),
    ],
)
def test_every_config_file_refuses_a_repeated_key_and_says_what_it_could_not_read(
    tmp_path: Path, load: object, error: type[ConfigFileError], what: str
) -> None:
    assert issubclass(error, ConfigFileError)
    path = tmp_path / "config.yaml"
    path.write_text("stop:\n  mode: auto\n  mode: dry-run\n")
    with pytest.raises(error, match=f"^{path}:3:3: YAML syntax error: key 'mode' repeats line 2$"):
        load(path)  # type: ignore[operator]
    path.write_text("stop: [mode: auto\n")
    with pytest.raises(error, match=f"^{path}:2:1: YAML syntax error: "):
        load(path)  # type: ignore[operator]
    with pytest.raises(error, match=f"^{tmp_path / 'nope.yaml'}: cannot read the {what}: "):
        load(tmp_path / "nope.yaml")  # type: ignore[operator]
