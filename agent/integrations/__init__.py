"""trainwarden in the trainers people already run: a callback or tracker in each
framework's own convention, running in the trainer's process.

- :mod:`.hf`: Hugging Face Transformers, ``Trainer(..., callbacks=[TrainwardenCallback()])``
  (``pip install 'trainwarden[hf]'``).
- :mod:`.lightning`: PyTorch Lightning, ``Trainer(..., callbacks=[TrainwardenCallback()])``
  (``pip install 'trainwarden[lightning]'``).

Each module imports its framework; ``import trainwarden.agent`` imports none of them. What
they share (starting the agent from the framework's facts, the per-step loss read off
the model's outputs without a host sync, a step timed across two callbacks, the tested
version ranges) is in :mod:`.common`.
"""
