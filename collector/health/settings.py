"""The rank-health evaluator's settings: its thresholds and how often it runs."""

from __future__ import annotations

from dataclasses import dataclass

from trainwarden.collector.health.crash_loops import LoopSettings
from trainwarden.collector.health.repeat_offenders import OffenderSettings


@dataclass(frozen=True)
class HealthSettings:
    dead_after_beats: float = 2.25
    hung_min_s: float = 5.0
    hung_steps: float = 5.0
    straggler_ratio: float = 1.2
    straggler_window: int = 5
    divergence_z: float = 6.0
    divergence_window: int = 5
    interval_s: float = 1.0
    max_cpu_share: float = 0.15  # of one core; past it evaluations are spaced out (Loop)
    crash_loop: LoopSettings = LoopSettings()  # what makes attempts a crash loop
    offenders: OffenderSettings = OffenderSettings()  # what makes a node a repeat offender
