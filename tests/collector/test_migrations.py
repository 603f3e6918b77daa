from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from trainwarden.collector.models import metadata
from trainwarden.collector.partitions import include_name


def test_migrations_build_exactly_the_models_schema(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        assert (
            compare_metadata(
                MigrationContext.configure(conn, opts={"include_name": include_name}), metadata
            )
            == []
        )
