"""The bench is a package by family (bench/README.md, "Layout"): every module imports, its
scripts run as ``python -m bench.<family>.<module>``, nothing in ``bench/`` or ``tests/``
edits ``sys.path``, and no private name crosses a file (issue 44)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
FAMILIES = ("harness", "precision", "int8", "weights", "optimize", "exporters")


def _sources(*folders: Path) -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for f in folders for p in sorted(f.rglob("*.py"))}


SOURCES = _sources(BENCH, ROOT / "tests")
BENCH_MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in SOURCES
    if p.is_relative_to(BENCH) and p.name != "__main__.py"
)


def test_the_bench_is_a_package_by_family() -> None:
    loose = sorted(
        p.name for p in BENCH.glob("*.py") if p.stem not in {"__init__", "__main__", "main"}
    )
    assert loose == [], f"bench modules outside a family: {loose}"
    for family in FAMILIES:
        assert (BENCH / family / "__init__.py").is_file(), f"bench/{family} is not a package"
    stray = sorted(
        str(p.parent) for p in BENCH.rglob("*.py") if not (p.parent / "__init__.py").is_file()
    )
    assert stray == [], f"folders of bench modules that are not packages: {stray}"


def _edits_sys_path(tree: ast.Module) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value  # sys.path.append(...), .insert, .extend
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t for t in targets if "sys.path" in ast.unparse(t)), None)
        if target is not None and ast.unparse(target).startswith("sys.path"):
            lines.append(node.lineno)
    return lines


def test_nothing_in_bench_or_tests_edits_sys_path() -> None:
    found = [f"{p.relative_to(ROOT)}:{n}" for p, t in SOURCES.items() for n in _edits_sys_path(t)]
    assert found == [], f"sys.path edited (import bench.<family>.<module> instead): {found}"


def _private_crossings(tree: ast.Module) -> list[str]:
    """``from bench.x import _name``, and ``alias._name`` where alias is a bench module."""
    found, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench"):
            for a in node.names:
                if a.name.startswith("_"):
                    found.append(f"{node.lineno}: {node.module}.{a.name}")
                aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            aliases.update(a.asname or a.name for a in node.names if a.name.startswith("bench"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_bench_name_crosses_a_file() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{c}" for p, t in SOURCES.items() for c in _private_crossings(t)
    ]
    assert found == [], found


@pytest.mark.parametrize("module", BENCH_MODULES)
def test_every_bench_module_imports(module: str) -> None:
    """Imported from the repository root, as ``python -m`` runs it (the heavy peers,
    torch's exporters and OpenVINO among them, are imported where they are used)."""
    importlib.import_module(module)
