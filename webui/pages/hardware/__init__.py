"""The hardware page, ``/runs/<name>/hardware``: each GPU's readings and XID errors."""
