"""Silence matching: whether a silence's matchers (``name=value`` or ``name=~regex``, as
Alertmanager has them) match an alert's labels."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any


def silence_matches(matchers: Sequence[dict[str, Any]], labels: dict[str, str]) -> bool:
    for mt in matchers:
        value = labels.get(mt["name"], "")
        if mt.get("regex"):
            if not re.fullmatch(mt["value"], value):
                return False
        elif value != mt["value"]:
            return False
    return True
