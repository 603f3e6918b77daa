"""Call one of the UI's Dash callbacks as the browser does: a POST to
``/_dash-update-component`` with the inputs' and states' values and the inputs that
changed, in the order given (Dash passes them to the callback as ``ctx.triggered``)."""

from __future__ import annotations

import json
from typing import Any

import dash


def dash_call(app: dash.Dash, output: str, values: dict[str, Any], changed: list[str]) -> Any:
    """The response of the callback whose output is ``output`` (``"id.prop"``, or its
    ``allow_duplicate`` form) and whose inputs include every one in ``changed`` (the
    inputs that fired). ``values``: ``"id.prop"`` -> value for its inputs and states
    (missing ones are None). Returns the response's ``{id: {prop: value}}``, {} when
    nothing is updated."""

    def outputs(key: str) -> list[str]:  # "a.b", or "..a.b...c.d.." for several
        return key.strip(".").split("...") if key.startswith("..") else [key]

    def fires(key: str) -> bool:
        inputs = {f"{d['id']}.{d['property']}" for d in app.callback_map[key]["inputs"]}
        return inputs.issuperset(changed)

    keys = [
        k
        for k in app.callback_map
        if output in [o.partition("@")[0] for o in outputs(k)] and fires(k)
    ]
    assert len(keys) == 1, (output, changed, keys)
    cb = app.callback_map[keys[0]]

    def items(deps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**d, "value": values.get(f"{d['id']}.{d['property']}")} for d in deps]

    outs = [dict(zip(("id", "property"), o.split(".", 1), strict=True)) for o in outputs(keys[0])]
    body = {
        "output": keys[0],
        "outputs": outs if keys[0].startswith("..") else outs[0],
        "inputs": items(cb["inputs"]),
        "state": items(cb["state"]),
        "changedPropIds": changed,
    }
    reply = app.server.test_client().post("/_dash-update-component", json=body)
    if reply.status_code == 204:  # PreventUpdate / every output no_update
        return {}
    assert reply.status_code == 200, reply.get_data(as_text=True)
    return json.loads(reply.get_data())["response"]
