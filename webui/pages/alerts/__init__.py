"""The alerts page, ``/alerts``: alerts, silences and actions, and their buttons."""
