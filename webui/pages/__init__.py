"""The UI's pages, a folder each: ``layout.py``, ``callbacks.py`` and the modules they use."""
