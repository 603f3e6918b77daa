"""Per-rank spike flags for loss and gradient norm, from running estimates.

Runs on the exporter thread, in step order. After ``warmup`` finite values:

- ``grad_norm_spike``: g > mu + k*sigma of the running estimate (k = 4);
- ``skip_suggested``: g > 20 mu (the step is likely to do damage: skip it);
- ``loss_spike``: loss >= 2x its running mean;
- ``nonfinite_loss`` / ``nonfinite_grad_norm``: NaN or Inf.

A flagged value does not update the estimate, so one spike cannot hide the next.
sigma has a floor of 1% of mu: a perfectly smooth series would otherwise flag noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Running:
    """Mean and variance: exact (Welford) during warm-up, then an EMA."""

    alpha: float
    n: int = 0
    mean: float = 0.0
    var: float = 0.0

    def update(self, x: float, *, warmup: int) -> None:
        self.n += 1
        if self.n <= warmup:
            delta = x - self.mean
            self.mean += delta / self.n
            self.var += (delta * (x - self.mean) - self.var) / self.n
        else:
            delta = x - self.mean
            self.mean += self.alpha * delta
            self.var = (1 - self.alpha) * (self.var + self.alpha * delta * delta)

    @property
    def std(self) -> float:
        return max(math.sqrt(max(self.var, 0.0)), 0.01 * abs(self.mean))


class SpikeDetector:
    def __init__(
        self,
        *,
        warmup: int = 20,
        k: float = 4.0,
        skip_factor: float = 20.0,
        loss_factor: float = 2.0,
        alpha: float = 0.02,
    ) -> None:
        self.warmup = warmup
        self.k = k
        self.skip_factor = skip_factor
        self.loss_factor = loss_factor
        self.grad = _Running(alpha)
        self.loss = _Running(alpha)

    def observe(self, *, loss: float | None, grad_norm: float | None) -> list[str]:
        flags: list[str] = []
        if loss is not None:
            if not math.isfinite(loss):
                flags.append("nonfinite_loss")
            elif self.loss.n >= self.warmup and loss >= self.loss_factor * self.loss.mean:
                flags.append("loss_spike")
            else:
                self.loss.update(loss, warmup=self.warmup)
        if grad_norm is not None:
            if not math.isfinite(grad_norm):
                flags.append("nonfinite_grad_norm")
            elif self.grad.n >= self.warmup and grad_norm > self.grad.mean + self.k * self.grad.std:
                flags.append("grad_norm_spike")
                if grad_norm > self.skip_factor * self.grad.mean:
                    flags.append("skip_suggested")
            else:
                self.grad.update(grad_norm, warmup=self.warmup)
        return flags
