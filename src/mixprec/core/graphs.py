"""Graph helpers shared by the passes: traversal, opsets, If branches, names, interface."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.ops import is_onnx_domain, onnx_domain, onnx_opset

__all__ = [
    "NodeExclusions",
    "UniqueNames",
    "add_initializer",
    "all_graphs",
    "exclude_patterns",
    "if_branch_owners",
    "is_constant_node",
    "iter_nodes",
    "keeps_io_dtype",
    "opset_of",
    "subgraphs_of",
]


def subgraphs_of(node: ir.Node) -> Iterator[ir.Graph]:
    """The graphs held in ``node``'s attributes (If branches, Loop/Scan bodies)."""
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.as_graph()
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.as_graphs()


def all_graphs(graph: ir.Graph) -> list[ir.Graph]:
    """``graph`` and every subgraph inside it, recursively."""
    return [graph, *(sub for node in iter_nodes(graph) for sub in subgraphs_of(node))]


def if_branch_owners(graph: ir.Graph) -> dict[ir.Graph, ir.Node]:
    """Every If branch graph (recursively) mapped to its If node."""
    owners: dict[ir.Graph, ir.Node] = {}
    for node in iter_nodes(graph):
        if node.op_type == "If" and is_onnx_domain(node.domain):
            for branch in subgraphs_of(node):
                owners[branch] = node
    return owners


def iter_nodes(graph: ir.Graph) -> Iterator[ir.Node]:
    """All nodes of ``graph`` and of its subgraphs, recursively."""
    yield from ir.traversal.RecursiveGraphIterator(graph)


def is_constant_node(node: ir.Node) -> bool:
    return node.op_type == "Constant" and is_onnx_domain(node.domain)


def opset_of(model: ir.Model, domain: str) -> int:
    key = onnx_domain(domain)
    version = onnx_opset(model.opset_imports) if key == "" else model.opset_imports.get(key)
    return int(version) if version is not None else 1


def keeps_io_dtype(keep_io_types: bool | frozenset[str], value: ir.Value) -> bool:
    """Whether a main-graph input or output keeps float32 under ``keep_io_types``."""
    if isinstance(keep_io_types, bool):
        return keep_io_types
    return (value.name or "") in keep_io_types


class UniqueNames:
    """Fresh value and node names, unique across the whole model (all graphs)."""

    def __init__(self, model: ir.Model) -> None:
        self.used: set[str] = set()
        for graph in all_graphs(model.graph):
            self.used.update(v.name for v in graph.inputs if v.name)
            self.used.update(graph.initializers)
            for node in graph:
                self.used.update(v.name for v in node.outputs if v.name)
                if node.name:
                    self.used.add(node.name)

    def fresh(self, base: str) -> str:
        name = base
        k = 1
        while name in self.used:
            name = f"{base}_{k}"
            k += 1
        self.used.add(name)
        return name


def add_initializer(graph: ir.Graph, names: UniqueNames, base: str, array: np.ndarray) -> ir.Value:
    """A new initializer of ``graph`` holding ``array``, under a fresh name from ``base``."""
    name = names.fresh(base)
    value = ir.Value(
        name=name,
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        shape=ir.Shape(list(array.shape)),
        const_value=ir.tensor(array, name=name),
    )
    graph.register_initializer(value)
    return value


def exclude_patterns(patterns: Iterable[str]) -> tuple[str, ...]:
    """``exclude_nodes`` (``--exclude``) checked once, for every config that takes it.

    Each must be a str that compiles as a regular expression: a bad one is one clear
    error here, not a crash later where :class:`NodeExclusions` compiles it.

    Example:
        >>> exclude_patterns(["head", "block_[0-3]"])
        ('head', 'block_[0-3]')
    """
    if isinstance(patterns, str):
        raise MixprecError("exclude_nodes must be a list of names or patterns")
    checked = tuple(patterns)
    for pattern in checked:
        if not isinstance(pattern, str):
            raise MixprecError(f"exclude_nodes must hold str, got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise MixprecError(f"bad exclude pattern {pattern!r}: {exc}") from None
    return checked


class NodeExclusions:
    """``--exclude``: node names or regular expressions (matching the whole name)."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self._patterns = [re.compile(p) for p in patterns]

    def reason(self, node: ir.Node) -> str | None:
        """Why ``node`` is excluded, or None."""
        name = node.name or ""
        for pattern in self._patterns:
            if pattern.pattern == name or pattern.fullmatch(name):
                return f"excluded by --exclude {pattern.pattern!r}"
        return None
