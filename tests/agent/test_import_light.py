import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import tomllib

import trainwarden.agent as tw

AGENT = Path(tw.__file__).parent


def imported(modules: tuple[str, ...], *also: str) -> list[str]:
    """Which of ``modules`` a fresh interpreter holds after ``import trainwarden.agent``
    (and the modules ``also``)."""
    code = (
        f"import sys, trainwarden.agent, {', '.join(('sys', *also))}\n"
        f"print(','.join(m for m in {modules!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_importing_the_agent_pulls_in_no_server_or_ui_library() -> None:
    heavy = ("fastapi", "sqlalchemy", "dash", "plotly", "starlette", "alembic", "flask")
    assert imported(heavy) == []


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The agent modules ``path`` imports, inside functions too; not those imported only
    for type hints (under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    hints = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for node in ast.walk(branch)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hints or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
        elif node.module == "trainwarden.agent":
            names = [a.name for a in node.names]
        elif node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            name = name.removeprefix("trainwarden.agent.")
            if name.split(".")[0] in modules:
                found.add(name.split(".")[0])
    return found - {path.stem}


def test_no_agent_module_imports_one_that_imports_it_back() -> None:
    modules = {p.stem for p in AGENT.glob("*.py")} - {"__init__"}
    graph = {m: _imports(AGENT / f"{m}.py", modules) for m in modules}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        return False

    cycles = sorted((a, b) for a in graph for b in graph[a] if reaches(b, a))
    assert cycles == []
    assert {"exporter", "relay", "spool"} <= {m for m in graph if "wire" in graph[m]}


def test_importing_the_agent_pulls_in_no_training_framework() -> None:
    frameworks = (
        "transformers",
        "lightning",
        "pytorch_lightning",
        "accelerate",
        "deepspeed",
        "ray",
        "torchtitan",
    )
    assert imported(frameworks) == []
    # nor what the integrations share: each framework's module imports its own
    assert imported(frameworks, "trainwarden.agent.integrations.common") == []


def test_the_extras_pin_the_tested_framework_ranges() -> None:
    """``pyproject.toml``'s extras and the version check at start say the same ranges."""
    from trainwarden.agent.integrations.common import TESTED, check_version

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"
    ]
    extras = project["optional-dependencies"]
    pins = {name: f"{name}>={low},<{high}" for name, (low, high) in TESTED.items()}
    assert pins["transformers"] in extras["hf"] and pins["accelerate"] in extras["hf"]
    assert extras["lightning"] == [pins["lightning"]]
    assert extras["accelerate"] == [pins["accelerate"]]
    assert extras["deepspeed"] == [pins["deepspeed"]]
    assert extras["ray"] == [pins["ray"].replace("ray", "ray[train]", 1)]
    assert extras["torchtitan"] == [pins["torchtitan"]]
    for name in TESTED:  # what CI installed is in the range
        assert check_version(name, importlib.metadata.version(name)) is None, name
