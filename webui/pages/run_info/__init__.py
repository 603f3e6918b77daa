"""The run page, ``/runs/<name>/info``: identity, attempts, goodput, checkpoints, data."""
