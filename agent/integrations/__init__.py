"""trainwarden in the trainers people already run: a callback or tracker in each
framework's own convention, running in the trainer's process.

- :mod:`.hf`: Hugging Face Transformers, ``Trainer(..., callbacks=[TrainwardenCallback()])``
  (``pip install 'trainwarden[hf]'``).
- :mod:`.lightning`: PyTorch Lightning, ``Trainer(..., callbacks=[TrainwardenCallback()])``
  (``pip install 'trainwarden[lightning]'``).
- :mod:`.accelerate`: Accelerate, ``Accelerator(log_with=[TrainwardenTracker(...)])`` and
  ``tracker.watch(accelerator, model, optimizer)`` (``pip install 'trainwarden[accelerate]'``).
- :mod:`.deepspeed`: DeepSpeed, ``tw_deepspeed.watch(engine)`` after ``deepspeed.initialize``
  (``pip install 'trainwarden[deepspeed]'``).
- :mod:`.ray`: Ray Train, ``TorchTrainer(tw_ray.wrap(train_loop), ...)`` with ``tw.step`` in
  the loop (``pip install 'trainwarden[ray]'``).
- :mod:`.torchtitan`: torchtitan's Trainer (CUDA), ``tw_torchtitan.build_trainer(config)``
  for ``config.build()`` (``pip install 'trainwarden[torchtitan]'``).

An FSDP2 (``fully_shard``) loop needs no integration: ``examples/fsdp2_trainer.py`` shows
``tw.step`` with the sampled profiler window and the replica groups of its mesh.

Each module imports its framework; ``import trainwarden.agent`` imports none of them. What
they share (starting the agent from the framework's facts, the per-step loss read off
the model's outputs without a host sync, a step timed across two callbacks, the tested
version ranges) is in :mod:`.common`.
"""
