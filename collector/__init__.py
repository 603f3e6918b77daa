"""trainwarden collector: FastAPI app, ingest, storage, queries and the CLI."""
