"""``tw.watch``'s options that have a variable of their own: how often the replicas are
checked and the determinism probe runs, and the probe's tolerance."""

from __future__ import annotations

from typing import Any

from .config import ConfigError, as_float, as_int, pick

REPLICA_CHECK_EVERY = 100
"""``tw.watch``'s default: fingerprint the parameters after one optimizer step in 100."""


def replica_check_every(value: Any) -> int:
    """``tw.watch(..., replica_check_every=N)``, else ``TRAINWARDEN_REPLICA_CHECK_EVERY``,
    else :data:`REPLICA_CHECK_EVERY`: check the replicas at steps whose number is a
    multiple of N; 0 turns the check off."""
    if isinstance(value, bool):  # True would read as 1: every step
        raise ConfigError(
            f"replica_check_every must be an integer (steps between checks, 0: off), got {value!r}"
        )
    return as_int(
        pick(value, "TRAINWARDEN_REPLICA_CHECK_EVERY", REPLICA_CHECK_EVERY),
        "replica_check_every (TRAINWARDEN_REPLICA_CHECK_EVERY; 0: off)",
        minimum=0,
    )


def determinism_probe_every(value: Any) -> int:
    """``tw.watch(..., determinism_probe_every=M)``, else
    ``TRAINWARDEN_DETERMINISM_PROBE_EVERY``, else 0 (off): run the determinism probe
    (:mod:`.probe`) at steps whose number is a multiple of M."""
    if isinstance(value, bool):
        raise ConfigError(
            "determinism_probe_every must be an integer (steps between probes, 0: off), "
            f"got {value!r}"
        )
    return as_int(
        pick(value, "TRAINWARDEN_DETERMINISM_PROBE_EVERY", 0),
        "determinism_probe_every (TRAINWARDEN_DETERMINISM_PROBE_EVERY; 0: off)",
        minimum=0,
    )


MAX_PROBE_RTOL = 0.1
"""A tolerance above this would hide real faults: refused."""


def probe_rtol(value: Any) -> float:
    """``tw.watch(..., probe_rtol=r)``, else ``TRAINWARDEN_PROBE_RTOL``, else 0 (the
    probes must be bit-identical): how far two replicas' probe sums may differ, relative
    to the output's L1 norm (:mod:`.probe`)."""
    what = "probe_rtol (TRAINWARDEN_PROBE_RTOL)"
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    number = as_float(
        pick(value, "TRAINWARDEN_PROBE_RTOL", 0.0), what, minimum=0.0, zero_is_off=True
    )
    if not number <= MAX_PROBE_RTOL:  # also NaN, inf
        raise ConfigError(
            f"{what} must be between 0 and {MAX_PROBE_RTOL} (0: bit-exact), got {number}"
        )
    return number
