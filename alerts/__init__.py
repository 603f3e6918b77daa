"""trainwarden alerts: the rule model and the default rule pack (issue 6).

Rules are data: ``load_rule_packs()`` reads the shipped pack (``DEFAULT_RULES``) and
your own files and checks them; each rule names a runbook in ``runbooks/``. The
evaluation engine, alert lifecycle and notifiers build on these types.
"""

from .intervals import Interval, parse_interval
from .lifecycle import Alert, advance, fingerprint
from .loading import load_rule_packs, load_rules, parse_rule
from .notification import Notification
from .rules import (
    DEFAULT_RULES,
    KINDS,
    RUNBOOKS_DIR,
    AbsenceRule,
    BaselineRule,
    CadenceRule,
    EventRule,
    PeerRule,
    RateRule,
    Rule,
    RuleError,
    ThresholdRule,
)

__all__ = [
    "DEFAULT_RULES",
    "KINDS",
    "RUNBOOKS_DIR",
    "AbsenceRule",
    "Alert",
    "BaselineRule",
    "CadenceRule",
    "EventRule",
    "Interval",
    "Notification",
    "PeerRule",
    "RateRule",
    "Rule",
    "RuleError",
    "ThresholdRule",
    "advance",
    "fingerprint",
    "load_rule_packs",
    "load_rules",
    "parse_interval",
    "parse_rule",
]
