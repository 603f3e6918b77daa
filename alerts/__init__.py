"""trainwarden alerts: rules, evaluation and notifiers (issue 6)."""
