"""The run overview, ``/runs/<name>``: one stacked figure, the run's facts, alerts and ranks."""
