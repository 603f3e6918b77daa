"""MkDocs hook: the HTTP API reference, rendered from the committed OpenAPI snapshot.

``mkdocs.yml`` names this file under ``hooks:``. A page that holds the marker
``<!-- openapi-reference -->`` (``api.md``) gets, in its place, a section per tag, a
subsection per path and method (summary, description, parameters, request body,
responses) and the schemas they name, from ``docs/reference/openapi.json``: the snapshot
that ``tests/collector/api/test_openapi_snapshot.py`` keeps equal to the app's schema. So the
page says what the collector serves without a running collector at build time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

MARKER = "<!-- openapi-reference -->"
SNAPSHOT = Path(__file__).resolve().parents[1] / "reference" / "openapi.json"
METHODS = ("get", "post", "put", "patch", "delete")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    spec = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    return markdown.replace(MARKER, render(spec))


def render(spec: dict[str, Any]) -> str:
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, item in spec.get("paths", {}).items():
        for method in METHODS:
            if method in item:
                op = item[method]
                tag = (op.get("tags") or ["other"])[0]
                by_tag.setdefault(tag, []).append((path, method, op))
    info = spec.get("info", {})
    out = [
        f"{info.get('title', 'API')} {info.get('version', '')}, OpenAPI "
        f"{spec.get('openapi', '')}: {text(info.get('description', ''))}",
        "",
    ]
    for tag, ops in by_tag.items():
        out += [f"### {tag.capitalize()}", ""]
        for path, method, op in ops:
            out += operation(path, method, op)
    schemas = spec.get("components", {}).get("schemas", {})
    if schemas:
        out += ["## Schemas", ""]
        for name, schema in schemas.items():
            out += schema_section(name, schema)
    return "\n".join(out)


def operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    anchor = re.sub(r"[^a-z0-9]+", "-", f"{method} {path}".lower()).strip("-")
    out = [f"#### `{method.upper()} {path}` {{#{anchor}}}", ""]
    if op.get("summary"):
        out += [f"**{op['summary']}**", ""]
    if op.get("description"):
        out += [text(op["description"]), ""]
    params = op.get("parameters", [])
    if params:
        out += [
            "| parameter | in | type | required | description |",
            "|---|---|---|---|---|",
        ]
        for p in params:
            required = "yes" if p.get("required") else "no"
            out.append(
                f"| `{p['name']}` | {p.get('in', '')} | {cell(type_of(p.get('schema', {})))} "
                f"| {required} | {cell(text(p.get('description', '')))} |"
            )
        out.append("")
    body = op.get("requestBody")
    if body:
        kinds = [f"`{ct}` {type_of(c.get('schema', {}))}" for ct, c in body["content"].items()]
        required = " (required)" if body.get("required") else ""
        out += [f"Request body{required}: " + "; ".join(kinds), ""]
    responses = op.get("responses", {})
    if responses:
        out += ["| response | description | body |", "|---|---|---|"]
        for status, resp in responses.items():
            content = resp.get("content", {})
            bodies = "; ".join(
                f"`{ct}` {type_of(c['schema'])}" if c.get("schema") else f"`{ct}`"
                for ct, c in content.items()
            )
            out.append(f"| {status} | {cell(text(resp.get('description', '')))} | {cell(bodies)} |")
        out.append("")
    return out


def schema_section(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### {name} {{#schema-{name.lower()}}}", ""]
    if schema.get("description"):
        out += [text(schema["description"]), ""]
    props = schema.get("properties", {})
    if props:
        required = set(schema.get("required", []))
        out += ["| field | type | required | description |", "|---|---|---|---|"]
        for field, sub in props.items():
            need = "yes" if field in required else "no"
            out.append(
                f"| `{field}` | {cell(type_of(sub))} | {need} "
                f"| {cell(text(sub.get('description', '')))} |"
            )
        out.append("")
    elif "enum" in schema or "type" in schema:
        out += [f"Type: {type_of(schema)}", ""]
    return out


def type_of(schema: dict[str, Any]) -> str:
    """A schema as a short phrase: a linked schema name, a type, its limits."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#schema-{name.lower()})"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            parts = [type_of(s) for s in schema[key]]
            phrase = " or ".join(dict.fromkeys(parts))
            return phrase + limits(schema)
    kind = schema.get("type", "")
    if "enum" in schema:
        phrase = " \\| ".join(f"`{v}`" for v in schema["enum"])
    elif "const" in schema:
        phrase = f"`{schema['const']}`"
    elif kind == "array":
        phrase = f"array of {type_of(schema.get('items', {}))}"
    elif kind == "object" and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        phrase = "object" if extra is True else f"object of {type_of(extra)}"
    else:
        phrase = str(kind) or "any"
    return phrase + limits(schema)


def limits(schema: dict[str, Any]) -> str:
    words = []
    for key, word in (
        ("minimum", "≥"),
        ("exclusiveMinimum", ">"),
        ("maximum", "≤"),
        ("exclusiveMaximum", "<"),
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
        ("minItems", "items ≥"),
        ("maxItems", "items ≤"),
    ):
        if key in schema:
            words.append(f"{word} {schema[key]}")
    if "pattern" in schema:
        words.append(f"pattern `{schema['pattern']}`")
    if "default" in schema:
        words.append(f"default `{json.dumps(schema['default'])}`")
    return f" ({', '.join(words)})" if words else ""


def text(value: str) -> str:
    """Docstring text as Markdown: ``code`` to `code`, and < > outside code escaped."""
    value = value.replace("``", "`")
    parts = value.split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def cell(value: str) -> str:
    """Text fit for one table cell: one line, pipes outside code spans escaped (a table
    leaves a pipe inside backticks alone)."""
    parts = " ".join(value.split()).split("`")
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"(?<!\\)\|", r"\\|", parts[i])
    return "`".join(parts)
