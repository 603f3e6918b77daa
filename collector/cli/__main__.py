"""``python -m trainwarden.collector.cli``: the ``trainwarden`` command."""

from trainwarden.collector.cli import main

main()
