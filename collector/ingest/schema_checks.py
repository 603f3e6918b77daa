"""The ingest wire format's bounds and patterns, and the checks its models share (a
timestamp in range, int64 ids, data source names, a data mixture, finite numbers)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from typing import Annotated, Any

from fastapi import Path as FastApiPath

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
MAX_RECORDS_PER_BATCH = 20_000
INT64_MAX = 2**63 - 1  # counters are stored as BIGINT
MAX_STEP = 2**62  # a step number the database and every query can hold
MAX_RANK = 1_000_000  # as world_size
RowId = Annotated[int, FastApiPath(ge=1, le=INT64_MAX, description="The row's id")]
"""An id in a URL path: past a BIGINT is not found, not an error of the database."""
MAX_FUTURE_S = 24 * 3600.0  # a timestamp further ahead than this is a broken clock


MIN_TS = 0.0  # epoch seconds: a negative one is no time at all
FINGERPRINT_PATTERN = r"^[0-9a-f]{32}$"
PROBE_WITHOUT_CHECK = "probe: sent without the step's fingerprint (a probed step is a checked step)"
SAMPLES_WITHOUT_DIGEST = "samples_kept / samples_epoch: sent without the step's samples_digest"
SOURCE_NAME = r"^[a-z][a-z0-9_.-]{0,31}$"  # as the agent's (agent/mixture.py)
MAX_SOURCES = 32
_source_name = re.compile(SOURCE_NAME).match


def check_int64(ids: list[int]) -> None:
    """Ids that fit int64, checked once a list (its least and greatest), not id by id."""
    if min(ids) < -INT64_MAX - 1 or max(ids) > INT64_MAX:
        raise ValueError("samples_kept: an id outside int64")


def check_sources(sources: dict[str, Any]) -> None:
    """A step's ``data_sources``: at most :data:`MAX_SOURCES` names of the agent's form."""
    if len(sources) > MAX_SOURCES:
        raise ValueError(f"data_sources: {len(sources)} sources, at most {MAX_SOURCES}")
    for name in sources:
        if not _source_name(name):
            raise ValueError(f"data_sources: source name {name[:40]!r} must match {SOURCE_NAME}")


def check_mixture(mixture: Any) -> dict[str, float]:
    """A declared data mixture (``tw.init(data_mixture=...)``): source names of the agent's
    form, weights >= 0 that sum to 1 (within 1e-6). Raises ``ValueError`` saying what."""
    if not isinstance(mixture, dict) or not mixture:
        raise ValueError("must be a mapping of source names to weights")
    check_sources(mixture)
    for name, weight in mixture.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"{name!r}: a weight must be a number, got {weight!r:.40}")
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{name!r}: a weight must be >= 0, got {weight!r}")
    total = sum(mixture.values())
    if abs(total - 1) > 1e-6:
        raise ValueError(f"the weights must sum to 1, they sum to {total:.6g}")
    return {name: float(w) for name, w in mixture.items()}


REPLICA_GROUP_PATTERN = r"^[0-9]+(-[0-9]+(:[0-9]+)?)?(,[0-9]+(-[0-9]+(:[0-9]+)?)?)*$"


def not_in_the_future(ts: float) -> float:
    """A plausible wall-clock time: after 1970, and not a day ahead of the collector's."""
    if not ts >= MIN_TS:  # also NaN
        raise ValueError(f"timestamp {ts} is before 1970: send epoch seconds")
    ahead = ts - time.time()
    if ahead > MAX_FUTURE_S:
        raise ValueError(
            f"timestamp is {ahead / 3600:.0f} h in the future: check this host's clock"
        )
    return ts


def all_finite(values: Iterable[Any]) -> bool:
    """Whether every number in ``values`` (None aside) is finite, in one C loop: a sum is
    finite when its terms are. False may be wrong (a sum that overflows, a non-number):
    then look row by row."""
    try:
        return math.isfinite(sum(filter(None, values)))
    except TypeError:
        return False
