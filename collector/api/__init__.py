"""The HTTP layer: authentication (``auth``), the Prometheus exporter (``prom``) and the
routes (``routes``), one module per resource.

May import every stage below it (store to incidents); imported only by the web UI's
server side, ``collector.app`` and the CLI.
"""
