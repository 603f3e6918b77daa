"""The determinism probe: identical replicas must compute identical outputs.

A replica check (:mod:`.replica`) compares parameters; a GPU whose arithmetic is wrong
can hold the right parameters and still compute wrong activations and gradients (and
DDP's all-reduce then spreads the wrong gradient to every replica, which stay equal).
The probe compares what the replicas *compute*: every ``determinism_probe_every`` steps,
right after the optimizer step (where the replica check runs too), each rank runs one
forward of the same fixed input under ``torch.no_grad()`` with the model in eval mode,
and fingerprints the output on the device. The collector compares the replicas' probes
as it compares their parameters.

What is sent (5 int64 words, one non-blocking copy, no host sync):

- words 1-2: :func:`.replica.fingerprint` of every floating-point tensor of the output
  (a tensor, or tensors inside tuples, lists, dicts, Hugging Face ``ModelOutput``), in
  order: bit-exact, for ``probe_rtol=0`` (the default);
- words 3-5: three float64 sums of the output, as their bit patterns: ``Σx``, ``Σ|x|``
  and ``Σ w·x`` with fixed pseudo-random signs ``w`` (a seeded generator: the same on
  every rank). With ``probe_rtol > 0`` the collector calls two replicas equal when each
  of the three differs by at most ``probe_rtol × Σ|x|``: for models whose kernels are not
  deterministic (atomics in a reduction, split-K matmuls chosen per run), where equal
  replicas differ in their last bits.

The input: ``probe_input=`` (a tensor, or a tuple of positional arguments, the same on
every rank), else one built from the shapes and dtypes of the model's first training
forward: floating tensors from a seeded normal distribution, integer tensors (token ids,
masks) from 0 and 1 (valid for any vocabulary), bool tensors all true; anything else
is passed as it was. The first forward's batch size is kept (a smaller ``probe_input``
is a cheaper probe). The probe runs the module inside a ``DistributedDataParallel``
wrapper (no collective, no gradient hooks); it leaves the step's phase marks as they
were (its time counts in the step's ``other`` phase) and puts each submodule's
train/eval mode back.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from typing import Any

from .replica import fingerprint

log = logging.getLogger(__name__)

SEED = 20261127
"""The generator seed of a built probe input and of the signs ``w``: equal on every rank."""
WORDS = 5
"""The int64 words a probe sends: 2 fingerprint words, 3 float64 sums as bits."""


def inner_module(model: Any) -> Any:
    """The module to probe: a DDP wrapper's own module (its forward would broadcast
    buffers and prepare gradient hooks), else ``model``."""
    import torch

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


def float_tensors(output: Any) -> Iterator[Any]:
    """The floating-point tensors of a forward's output, in a fixed order."""
    import torch

    if isinstance(output, torch.Tensor):
        if output.is_floating_point() and output.numel():
            yield output
    elif isinstance(output, dict):  # ModelOutput is an OrderedDict
        for value in output.values():
            yield from float_tensors(value)
    elif isinstance(output, (list, tuple)):
        for value in output:
            yield from float_tensors(value)


class Probe:
    """One model's probe: its input (given, or built from the first forward) and the
    signs of its third sum, kept per output size and device."""

    def __init__(self, model: Any, probe_input: Any = None) -> None:
        self.module = inner_module(model)
        self.args: tuple[Any, ...] | None = None
        self.kwargs: dict[str, Any] = {}
        if probe_input is not None:
            self.args = probe_input if isinstance(probe_input, tuple) else (probe_input,)
        self._signs: dict[tuple[int, Any], Any] = {}
        self.unusable: str | None = None
        """Why no probe can run (the first forward's input could not be copied)."""

    @property
    def needs_input(self) -> bool:
        return self.args is None and self.unusable is None

    def learn_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """From the first training forward's arguments: same shapes and dtypes, fixed
        values (see the module's docstring). Called once, on the training thread."""
        import torch

        generator = torch.Generator().manual_seed(SEED)

        def build(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                shape, dtype = tuple(value.shape), value.dtype
                if dtype.is_floating_point:
                    made = torch.randn(shape, generator=generator, dtype=torch.float64)
                    return made.to(dtype).to(value.device)
                if dtype == torch.bool:
                    return torch.ones(shape, dtype=dtype, device=value.device)
                if dtype.is_complex:
                    raise ValueError("a complex input: give probe_input=")
                made = torch.randint(0, 2, shape, generator=generator, dtype=torch.int64)
                return made.to(dtype).to(value.device)
            if isinstance(value, (list, tuple)):
                return type(value)(build(v) for v in value)
            if isinstance(value, dict):
                return {k: build(v) for k, v in value.items()}
            return value

        try:
            self.args = tuple(build(a) for a in args)
            self.kwargs = {k: build(v) for k, v in kwargs.items()}
        except (TypeError, ValueError, RuntimeError) as exc:
            self.unusable = f"the first forward's input could not be rebuilt ({exc})"[:200]
            log.warning("trainwarden: determinism probe off: %s", self.unusable)

    def run(self) -> Any:
        """Queue the probe on the device: an int64 tensor of :data:`WORDS` words, or
        ``None`` when the output has no floating-point tensor."""
        import torch

        if self.args is None:
            return None
        modes = [(m, m.training) for m in self.module.modules()]
        try:
            self.module.eval()
            with torch.no_grad():
                outputs = list(float_tensors(self.module(*self.args, **self.kwargs)))
        finally:
            for m, training in modes:
                m.training = training
        if not outputs:
            return None
        with torch.no_grad():
            words = fingerprint(outputs)
            device = words.device
            flat = torch.cat([t.detach().reshape(-1).to(device, torch.float64) for t in outputs])
            sums = torch.stack([flat.sum(), flat.abs().sum(), torch.dot(flat, self._sign(flat))])
            return torch.cat([words, sums.view(torch.int64)])

    def _sign(self, flat: Any) -> Any:
        import torch

        key = (flat.numel(), flat.device)
        signs = self._signs.get(key)
        if signs is None:
            generator = torch.Generator().manual_seed(SEED + 1)
            bits = torch.randint(0, 2, (flat.numel(),), generator=generator)
            signs = self._signs[key] = (bits * 2 - 1).to(flat.device, torch.float64)
        return signs


def decode(words: list[int]) -> tuple[list[int], list[float]]:
    """The :data:`WORDS` integers read back: (the fingerprint's 2 words, the 3 sums)."""
    sums = [struct.unpack("<d", struct.pack("<q", w))[0] for w in words[2:WORDS]]
    return words[:2], sums
