"""The ranks page, ``/runs/<name>/ranks``: rank x step heatmaps, rank states, collectives."""
