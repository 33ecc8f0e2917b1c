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
    ("inputs",),
    ("passes",),
    ("runtime",),
    ("calibrate",),
    ("precision", "int8", "weights"),
    ("checks",),
    ("pipeline",),
    ("tune",),
    ("repair",),
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
    engines = ("mixprec.runtime.ort", "mixprec.runtime.ort_sessions", "mixprec.runtime.openvino")
    registry = {"mixprec.runtime.engines", *engines}
    within = {
        module: found
        for module, tree in MODULES.items()
        if _layer(module) == "runtime" and module not in registry
        for found in [[t for node, _ in _imports(tree) for t in _targets(node) if t in engines]]
        if found
    }
    assert within == {}, within


def test_no_module_reaches_an_engine_through_importlib() -> None:
    """``importlib.import_module("onnxruntime")`` (or ``__import__``) outside ``runtime/``
    would get around the door above without an import statement to see."""
    found = [
        f"{module}:{node.lineno}"
        for module, tree in MODULES.items()
        if _layer(module) != "runtime"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
        in ("import_module", "__import__", "find_spec")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and str(node.args[0].value).startswith(ENGINE_IMPORTS)
    ]
    assert found == [], found


def test_one_function_opens_an_onnxruntime_session() -> None:
    """Session options, providers and the IR-version retry live in one place: a second
    ``InferenceSession(...)`` would open sessions that miss them (issue 44)."""
    calls = [
        f"{module}:{node.lineno}"
        for module, tree in MODULES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "InferenceSession"
    ]
    assert len(calls) == 1 and calls[0].startswith("mixprec.runtime.ort_sessions:"), calls


def _module_graph() -> dict[str, set[str]]:
    """Each module's imports of other mixprec modules, TYPE_CHECKING ones included (a
    circle that only type checking closes is still one a reader walks round)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
                targets = [node.module, *(n for n in names if n in MODULES)]
            else:
                continue
            edges[module] |= {t for t in targets if t in MODULES and t != module}
    return edges


def test_no_import_circles() -> None:
    """No module reaches itself through its imports (the package's ``__init__`` files,
    which re-export what lies below them, aside)."""
    edges = {
        m: {t for t in ts if not _is_package(t)}
        for m, ts in _module_graph().items()
        if not _is_package(m)
    }
    circles = []
    for start in edges:
        seen, stack = set(), [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert circles == [], sorted(set(circles))[:5]


def _is_package(module: str) -> bool:
    return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").is_file()


_WEIGHTED_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})


def test_no_hand_written_list_of_weighted_layers_outside_core() -> None:
    """Which ops are weighted layers is the registry's fact (``layer=``), read through
    ``core.layers`` (issue 44: the list was written 9 times with 4 memberships)."""
    found = []
    for module, tree in MODULES.items():
        if _layer(module) == "core":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Tuple | ast.List | ast.Set):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if len(names & _WEIGHTED_OPS) >= 2:
                    found.append(f"{module}:{node.lineno}: {sorted(names & _WEIGHTED_OPS)}")
    assert found == [], found
