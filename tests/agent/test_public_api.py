import trainwarden.agent as tw


def test_all_is_sorted_and_every_name_exists() -> None:
    assert tw.__all__ == sorted(tw.__all__)
    for name in tw.__all__:
        assert hasattr(tw, name), name


def test_the_readme_surface_is_public() -> None:
    for name in ("init", "step", "shutdown"):
        assert name in tw.__all__


def test_run_identity_and_checkpoint_cost_are_public() -> None:
    import inspect

    for name in ("checkpoint_saved", "checkpointing", "checkpoint_drained", "Checkpointing"):
        assert name in tw.__all__
    assert {"config", "tags", "data_snapshot"} <= set(inspect.signature(tw.init).parameters)
    keywords = set(inspect.signature(tw.checkpoint_saved).parameters)
    assert {"seconds", "bytes", "drain_seconds"} <= keywords
