"""Reading a Dash layout in tests: walk its components, their text and classes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def walk(component: Any) -> Iterator[Any]:
    """Every Dash component under ``component`` (itself included)."""
    if isinstance(component, (list, tuple)):
        for child in component:
            yield from walk(child)
        return
    if not hasattr(component, "to_plotly_json"):
        return
    yield component
    yield from walk(getattr(component, "children", None))


def text(component: Any) -> str:
    """What a reader sees: cells and blocks apart, a line's words and spans as written."""
    if isinstance(component, (list, tuple)):
        inline = any(isinstance(c, str) for c in component)
        return ("" if inline else " ").join(text(c) for c in component)
    if isinstance(component, (str, int, float)):
        return str(component)
    return text(getattr(component, "children", None) or [])


def classes_of(component: Any) -> list[str]:
    return (getattr(component, "className", "") or "").split()


def classes(component: Any) -> list[str]:
    return [c for part in walk(component) for c in classes_of(part)]
