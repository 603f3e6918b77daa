from __future__ import annotations

import random

from trainwarden.agent.spikes import SpikeDetector


def series(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [1.0 + 0.05 * rng.gauss(0, 1) for _ in range(n)]


def test_a_grad_norm_spike_is_flagged_on_its_step_not_before() -> None:
    detector = SpikeDetector()
    values = series(100)
    values[60] = 30.0
    flags = [detector.observe(loss=None, grad_norm=v) for v in values]
    flagged = [i for i, f in enumerate(flags) if "grad_norm_spike" in f]
    assert flagged == [60]
    assert "skip_suggested" in flags[60]  # 30 > 20 x ~1.0


def test_nothing_is_flagged_during_warm_up() -> None:
    detector = SpikeDetector(warmup=20)
    flags = [detector.observe(loss=v, grad_norm=v) for v in [1.0, 50.0, 1.0] + series(10)]
    assert not any(flags)


def test_loss_spike_and_non_finite_values() -> None:
    detector = SpikeDetector()
    for v in series(30):
        assert detector.observe(loss=v, grad_norm=v) == []
    assert detector.observe(loss=2.5, grad_norm=1.0) == ["loss_spike"]
    assert detector.observe(loss=float("nan"), grad_norm=float("inf")) == [
        "nonfinite_loss",
        "nonfinite_grad_norm",
    ]
    # A spike does not move the estimate: the next normal value is not flagged.
    assert detector.observe(loss=1.0, grad_norm=1.0) == []
