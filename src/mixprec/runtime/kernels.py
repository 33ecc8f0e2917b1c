"""Kernels an engine has and runs: the kernel probe of an opset upgrade
(:func:`missing_kernels`, through :meth:`Engine.has_kernel`), and which kernels ONNX
Runtime's CPU provider really runs, read from its optimized graph
(:func:`integer_kernel_share`, through :meth:`Engine.kernel_graph`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import onnx
import onnx_ir as ir

from mixprec.core.registry import registered
from mixprec.runtime.engine import Engine, RuntimeOptions
from mixprec.runtime.engines import engine_for

__all__ = ["FLOAT_KERNELS", "INTEGER_KERNELS", "integer_kernel_share", "missing_kernels"]

#: ONNX Runtime kernels that run a Conv/MatMul/Gemm in integers.
INTEGER_KERNELS = frozenset(
    {
        "QLinearConv",
        "QLinearMatMul",
        "MatMulInteger",
        "ConvInteger",
        "QGemm",
        "MatMulIntegerToFloat",
        "DynamicQuantizeMatMul",
        "QLinearConvTranspose",
    }
)
#: ONNX Runtime kernels that run a weighted layer in float: the layers themselves (the
#: registry's) and ORT's fused forms of them.
FLOAT_KERNELS = frozenset(
    {op for (domain, op), info in registered() if info.layer and not domain}
    | {"FusedConv", "FusedMatMul", "FusedGemm", "NchwcConv"}
)


def missing_kernels(
    model: ir.Model, op_types: Sequence[str], opset: int, engine: Engine | None = None
) -> list[str]:
    """``op_type-opset`` of the main graph's nodes of ``op_types`` that ``engine``
    (default: ONNX Runtime's CPU provider) has no kernel for at ``opset`` (with their
    input dtypes): e.g. ``RandomNormalLike-22``, which ORT 1.32 implements only up to
    opset 21."""
    engine = engine or engine_for(RuntimeOptions())
    wanted = set(op_types)
    missing: list[str] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for node in model.graph:
        if node.domain not in ("", "ai.onnx") or node.op_type not in wanted:
            continue
        key = (node.op_type, tuple(int(v.dtype or 0) for v in node.inputs if v is not None))
        if key in seen:
            continue
        seen.add(key)
        if not engine.has_kernel(node, {"": opset}):
            version = onnx.defs.get_schema(node.op_type, opset).since_version
            missing.append(f"{node.op_type}-{version}")
    return sorted(set(missing))


def integer_kernel_share(
    proto: onnx.ModelProto,
    macs: Mapping[str, int],
    outputs: Mapping[str, str] | None = None,
    engine: Engine | None = None,
) -> tuple[float | None, dict[str, int]]:
    """Share of the given nodes' MACs that ``engine`` (default: ONNX Runtime's CPU
    provider) runs in integer kernels, read from its optimized graph
    (:meth:`Engine.kernel_graph`; ``(None, {})`` where it shows none), and the count of
    each compute kernel there.

    A fused integer kernel writes the output of the QuantizeLinear that followed the
    node (or the Relu/Clip it absorbed), so kernels are traced back by that name;
    ``outputs`` adds other output -> node pairs (a dynamic MatMul's fused kernel writes
    the original MatMul's output).
    """
    optimized = (engine or engine_for(RuntimeOptions())).kernel_graph(proto)
    if optimized is None:
        return None, {}
    kinds = Counter(
        n.op_type for n in optimized.graph.node if n.op_type in INTEGER_KERNELS | FLOAT_KERNELS
    )
    producer = {out: node for node in proto.graph.node for out in node.output}
    # Q output -> the compute node it quantizes (nodes without counted MACs are left out)
    source: dict[str, str] = {k: v for k, v in (outputs or {}).items() if v in macs}
    for node in proto.graph.node:
        if node.op_type != "QuantizeLinear":
            continue
        before = producer.get(node.input[0])
        if before is not None and before.op_type in ("Relu", "Clip"):
            before = producer.get(before.input[0])
        if before is not None and before.name in macs:
            source[node.output[0]] = before.name
    # A fused kernel may also absorb the bias Add that follows (MatMulIntegerToFloat).
    readers = Counter(name for node in proto.graph.node for name in node.input)
    for node in proto.graph.node:
        fed = [name for name in node.input if name in source and readers[name] == 1]
        if node.op_type == "Add" and len(fed) == 1:
            source.setdefault(node.output[0], source[fed[0]])
    integer = sum(
        macs[source[out]]
        for n in optimized.graph.node
        if n.op_type in INTEGER_KERNELS
        for out in n.output
        if out in source
    )
    total = sum(macs.values())
    return (integer / total if total else None), dict(kinds)  # None: no counted MACs
