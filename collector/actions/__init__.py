"""Actions: the engine that rolls runs back, evicts nodes and stops runs (``engine``),
the check of a rollback's result (``rollback_check``) and the scheduler backends for
evictions (``evict``).

May import ``collector.read`` and below; a sibling of health, alerting and incidents.
"""
