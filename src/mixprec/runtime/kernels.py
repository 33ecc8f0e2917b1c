"""Which kernels ONNX Runtime's CPU provider really runs: read from its optimized graph."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Mapping

import onnx
import onnxruntime as ort

from mixprec.core.config import ort_log_severity
from mixprec.runtime.ort import thread_cap

__all__ = ["FLOAT_KERNELS", "INTEGER_KERNELS", "integer_kernel_share"]

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
FLOAT_KERNELS = frozenset(
    {
        "Conv",
        "ConvTranspose",
        "MatMul",
        "Gemm",
        "FusedConv",
        "FusedMatMul",
        "FusedGemm",
        "NchwcConv",
    }
)


def integer_kernel_share(
    proto: onnx.ModelProto, macs: Mapping[str, int], outputs: Mapping[str, str] | None = None
) -> tuple[float | None, dict[str, int]]:
    """Share of the given nodes' MACs that ONNX Runtime's CPU provider runs in integer
    kernels, read from its optimized graph, and the count of each compute kernel there.

    A fused integer kernel writes the output of the QuantizeLinear that followed the
    node (or the Relu/Clip it absorbed), so kernels are traced back by that name;
    ``outputs`` adds other output -> node pairs (a dynamic MatMul's fused kernel writes
    the original MatMul's output).
    """
    with tempfile.TemporaryDirectory(prefix="mixprec-") as folder:
        path = os.path.join(folder, "optimized.onnx")
        options = ort.SessionOptions()
        options.intra_op_num_threads = thread_cap(0)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = path
        options.log_severity_level = ort_log_severity()
        ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(path, load_external_data=False)
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
