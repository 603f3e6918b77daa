import trainwarden.agent as tw


def test_all_is_sorted_and_every_name_exists() -> None:
    assert tw.__all__ == sorted(tw.__all__)
    for name in tw.__all__:
        assert hasattr(tw, name), name


def test_the_readme_surface_is_public() -> None:
    for name in ("init", "step", "shutdown"):
        assert name in tw.__all__
