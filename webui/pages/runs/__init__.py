"""The runs list, ``/``: every run, its status, firing alerts, ranks and last step."""
