"""HTTP routes, one module per resource: runs and ingest (``runs``), alerts, actions,
incidents and timelines, economics, and the OTLP receiver."""
