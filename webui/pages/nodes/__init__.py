"""The nodes' records across runs: the list at ``/nodes``, one node at ``/nodes/<name>``."""
