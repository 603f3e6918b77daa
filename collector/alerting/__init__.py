"""Alerting with the database: the engine that evaluates the rules
(``trainwarden.alerts``) against each run's snapshot, stores alert lifecycles, routes
silences, inhibition and storms, and hands notifications to the notifier thread.

May import ``collector.read`` and below; a sibling of health, actions and incidents.
"""
