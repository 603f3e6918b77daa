"""The timeline page, ``/runs/<name>/timeline``: incidents, their entries and the logbook."""
