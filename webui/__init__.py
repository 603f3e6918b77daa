"""trainwarden web UI (Dash)."""
