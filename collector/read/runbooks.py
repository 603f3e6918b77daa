"""Runbooks served rendered at ``/runbooks/<Name>``, and the loaded rules at ``/api/v1/rules``.

Every alert links to its rule's runbook; an on-call engineer opens it from a page or a
chat message at 3 a.m., so it is plain server-rendered HTML (no script), readable in
light and dark. Runbooks are looked up in the folders given to ``serve --runbooks``
first, then in the ones trainwarden ships. Raw HTML in a runbook is shown as text.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse
from markdown_it import MarkdownIt

from trainwarden.alerts import RUNBOOKS_DIR, Rule

router = APIRouter()
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
_md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")

_PAGE = (
    "<!doctype html>\n"
    '<html lang="en"><head><meta charset="utf-8">\n'
    '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
    "<title>{title} · trainwarden runbook</title>\n"
    "<style>\n"
    ":root {{ color-scheme: light dark; --fg: #1d2430; --bg: #ffffff; --muted: #5b6575; "
    "--code: #f2f4f7; --line: #d9dee6; }}\n"
    "@media (prefers-color-scheme: dark) {{\n"
    "  :root {{ --fg: #e6e9ef; --bg: #12161d; --muted: #9aa4b2; --code: #1d232d; "
    "--line: #2c3440; }}\n"
    "}}\n"
    "body {{ font: 16px/1.55 system-ui, sans-serif; color: var(--fg); background: var(--bg);\n"
    "       max-width: 52rem; margin: 2rem auto; padding: 0 1rem; }}\n"
    "a {{ color: #3d7bfd; }} "
    "nav {{ color: var(--muted); font-size: .9rem; margin-bottom: 1rem; }}\n"
    "h1 {{ margin-bottom: .2rem; }} "
    "h2 {{ border-bottom: 1px solid var(--line); padding-bottom: .2rem; margin-top: 2rem; }}\n"
    "code {{ background: var(--code); padding: .1rem .3rem; border-radius: 4px; "
    "font-size: .9em; }}\n"
    "pre {{ background: var(--code); padding: .8rem 1rem; border-radius: 6px; "
    "overflow-x: auto; }}\n"
    "pre code {{ padding: 0; }} table {{ border-collapse: collapse; }}\n"
    "td, th {{ border: 1px solid var(--line); padding: .3rem .6rem; text-align: left; }}\n"
    "</style></head>\n"
    '<body><nav><a href="/runbooks">runbooks</a> · <a href="/">trainwarden</a></nav>\n'
    "{body}\n"
    "</body></html>\n"
)


def runbook_dirs(request: Request) -> list[Path]:
    return [*getattr(request.app.state, "runbook_dirs", []), RUNBOOKS_DIR]


def find_runbook(dirs: list[Path], name: str) -> Path | None:
    """The runbook file called ``name`` (with or without ``.md``), first folder first."""
    stem = name[:-3] if name.endswith(".md") else name
    if not NAME.match(stem):
        return None
    for folder in dirs:
        path = folder / f"{stem}.md"
        if path.is_file():
            return path
    return None


def render(markdown: str, *, title: str) -> str:
    return _PAGE.format(title=html.escape(title), body=_md.render(markdown))


def runbook_url(base: str | None, runbook: str) -> str:
    """Where an alert's runbook is served: absolute when the external URL is known."""
    stem = runbook[:-3] if runbook.endswith(".md") else runbook
    return f"{(base or '').rstrip('/')}/runbooks/{stem}"


@router.get("/runbooks", response_class=HTMLResponse, tags=["runbooks"])
def list_runbooks(request: Request) -> HTMLResponse:
    """Every runbook, with the rules that link to it."""
    rules: list[Rule] = getattr(request.app.state, "rules", [])
    by_runbook: dict[str, list[str]] = {}
    for rule in rules:
        by_runbook.setdefault(rule.runbook[:-3], []).append(rule.name)
    names = sorted({p.stem for d in runbook_dirs(request) if d.is_dir() for p in d.glob("*.md")})
    items = "\n".join(
        f'<li><a href="/runbooks/{html.escape(n)}">{html.escape(n)}</a>'
        + (f" — rules: {html.escape(', '.join(by_runbook[n]))}" if n in by_runbook else "")
        + "</li>"
        for n in names
    )
    return HTMLResponse(
        _PAGE.format(title="Runbooks", body=f"<h1>Runbooks</h1>\n<ul>\n{items}\n</ul>")
    )


@router.get("/runbooks/{name}", response_class=HTMLResponse, tags=["runbooks"])
def get_runbook(name: str, request: Request) -> HTMLResponse:
    """One runbook, rendered (``?format=md`` for the Markdown source)."""
    path = find_runbook(runbook_dirs(request), name)
    if path is None:
        raise HTTPException(404, f"no runbook named {name!r}; see /runbooks for the list")
    text = path.read_text(encoding="utf-8")
    if request.query_params.get("format") == "md":
        return HTMLResponse(text, media_type="text/markdown; charset=utf-8")
    return HTMLResponse(render(text, title=path.stem))


@router.get("/api/v1/rules", tags=["alerts"])
def get_rules(request: Request) -> list[dict[str, Any]]:
    """The alert rules this collector loaded (the default pack and ``serve --rules``
    files), each with the URL of its runbook."""
    base = request.app.state.settings.external_url
    return [
        {
            **rule.model_dump(mode="json", by_alias=True),
            "runbook_url": runbook_url(base, rule.runbook),
        }
        for rule in getattr(request.app.state, "rules", [])
    ]
