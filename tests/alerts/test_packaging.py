"""The wheel ships the default rule pack and the runbooks where the loader looks for them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

from trainwarden.alerts import DEFAULT_RULES, RUNBOOKS_DIR

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_the_rules_and_runbooks_next_to_the_package(tmp_path: Path) -> None:
    # Build from a copy of what the package-dir names, so the checkout gets no build/.
    src = tmp_path / "src"
    src.mkdir()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {p.split("/")[0] for p in pyproject["tool"]["setuptools"]["package-dir"].values()}
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in folders:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("trainwarden-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    # the loader resolves both from alerts/rules.py: rules/default.yaml beside it, and
    # ../runbooks/ (the repository's runbooks/ here, trainwarden/runbooks/ in the wheel)
    assert DEFAULT_RULES == ROOT / "alerts" / "rules" / "default.yaml"
    assert RUNBOOKS_DIR == ROOT / "runbooks"
    assert "trainwarden/alerts/rules/default.yaml" in names
    shipped = {
        n.removeprefix("trainwarden/runbooks/")
        for n in names
        if n.startswith("trainwarden/runbooks/")
    }
    assert shipped == {p.name for p in RUNBOOKS_DIR.glob("*.md")}
