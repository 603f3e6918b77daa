"""Incidents: grouping alerts and actions into incidents (``store``), the engine loop
that does it and posts reports (``engine``), the run's timeline (``timeline``) and the
post-mortem report (``postmortem``).

May import ``collector.read`` and below; a sibling of health, alerting and actions.
"""
