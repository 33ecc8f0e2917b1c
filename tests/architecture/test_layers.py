"""The package's own import graph keeps the layout's rule (docs/contributing.md): imports run
one way through the layers, none inside functions (but the optional extras), no private
name is taken from another module, and no module or function outgrows the limits."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "mixprec"
#: Lowest first; a module may import its own layer and the ones before it.
LAYERS = (
    ("core",),
    ("io",),
    ("passes",),
    ("runtime",),
    ("calibrate",),
    ("precision", "int8", "weights"),
    ("pipeline",),
    ("tune",),
    ("guard",),
    ("optimize",),
    ("report",),
    ("api",),
    ("batch",),
    ("torch", "cli"),
    ("__init__", "__main__"),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
#: Optional extras, the only imports allowed inside functions.
OPTIONAL = ("torch", "matplotlib", "playwright", "ray", "openvino")


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(("mixprec", *parts))] = ast.parse(path.read_text(), str(path))
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(tree: ast.Module) -> list[tuple[ast.ImportFrom | ast.Import, bool]]:
    """Every import and whether it sits inside a function (TYPE_CHECKING blocks skipped)."""
    skipped = {
        id(x)
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
        for x in ast.walk(n)
    }
    local = {
        id(x)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for x in ast.walk(f)
        if x is not f
    }
    return [
        (n, id(n) in local)
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skipped
    ]


def _targets(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [node.module or ""] if node.level == 0 else ["<relative>"]


MODULES = _modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_down_the_layers(module: str) -> None:
    mine = RANK[_layer(module)]
    climbs, local, private = [], [], []
    for node, in_function in _imports(MODULES[module]):
        for target in _targets(node):
            ours = target.startswith("mixprec") or target == "<relative>"
            if ours and target != "mixprec" and RANK.get(_layer(target), 99) > mine:
                climbs.append(target)
            if module != "mixprec" and target == "mixprec":
                climbs.append("mixprec (the package's public surface)")
            if in_function and (ours or not target.startswith(OPTIONAL)):
                local.append(target)
            if ours and isinstance(node, ast.ImportFrom) and target != module:
                private += [a.name for a in node.names if a.name.startswith("_")]
    assert climbs == [], f"{module} imports a higher layer: {climbs}"
    assert local == [], f"{module} imports inside a function: {local}"
    assert [p for p in private if not p.startswith("__")] == [], f"{module} takes {private}"


def test_no_module_or_function_outgrows_the_limits() -> None:
    too_big = []
    for module, tree in MODULES.items():
        lines = max((n.end_lineno or 0) for n in tree.body) if tree.body else 0
        if lines > 600:
            too_big.append(f"{module}: {lines} lines")
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (n.end_lineno or n.lineno) - n.lineno + 1
                if length > 100:
                    too_big.append(f"{module}.{n.name}: {length} lines")
    assert too_big == []


def test_every_subpackage_has_a_layer() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders <= set(RANK), folders - set(RANK)
    assert len(folders) >= 6


#: The engines' own libraries and modules: only ``runtime/`` opens them (its one door).
ENGINE_IMPORTS = ("onnxruntime", "openvino", "mixprec.runtime.ort", "mixprec.runtime.openvino")


def test_only_the_runtime_door_imports_an_engine() -> None:
    """Every model run goes through ``runtime.engines`` (issue 35): a module outside
    ``runtime/`` that imported ONNX Runtime, OpenVINO or their engine modules would be a
    caller a third engine (a GPU provider) has to be edited into."""
    outside = {
        module: found
        for module, tree in MODULES.items()
        if _layer(module) != "runtime"
        for found in [
            [
                t
                for node, _ in _imports(tree)
                for t in _targets(node)
                if t.startswith(ENGINE_IMPORTS)
            ]
        ]
        if found
    }
    assert outside == {}, outside
    # inside runtime/, the engine modules are reached only through its registry
    registry = {"mixprec.runtime.engines", "mixprec.runtime.ort", "mixprec.runtime.openvino"}
    within = {
        module: found
        for module, tree in MODULES.items()
        if _layer(module) == "runtime" and module not in registry
        for found in [
            [
                t
                for node, _ in _imports(tree)
                for t in _targets(node)
                if t in ("mixprec.runtime.ort", "mixprec.runtime.openvino")
            ]
        ]
        if found
    }
    assert within == {}, within
