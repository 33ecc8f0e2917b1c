"""ONNX Runtime's transformer graph fusions, as a careful user would try them before
lowering a precision: ``onnxruntime.transformers.optimizer`` at ``opt_level`` 0 (its
Python fusions only, no session-level rewrite baked into the file) turns a BERT-style
encoder's subgraphs into ORT's contrib kernels: Attention, SkipLayerNormalization,
BiasGelu, EmbedLayerNormalization. The weights are not changed; the fused kernels sum in
another order, so the result is FP32 that rounds differently, and it runs in ONNX Runtime
only (the ``com.microsoft`` domain).

The optimizer cannot always read the head count from a graph whose reshapes take their
shape from a Concat (MiniLM exported by torch): :func:`attention_shape` reads it from the
constants beside the width of the LayerNormalization scales."""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.transformers import optimizer

from mixprec.core.limits import INLINE_LIMIT

__all__ = ["FUSED_OPS", "attention_shape", "transformer_fused"]

#: The fused kernels counted as a fusion that applied (the optimizer's statistics).
FUSED_OPS = (
    "Attention",
    "MultiHeadAttention",
    "EmbedLayerNormalization",
    "SkipLayerNormalization",
    "BiasGelu",
    "FastGelu",
    "Gelu",
)
#: Op types without which no transformer fusion applies (the optimizer is not run).
_NORMS = frozenset({"LayerNormalization", "ReduceMean"})


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Small integer constants by name: initializers and Constant nodes' values."""
    found = {
        t.name: numpy_helper.to_array(t)
        for t in model.graph.initializer
        if t.data_type == onnx.TensorProto.INT64 and np.prod(t.dims, dtype=np.int64) <= 8
    }
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            value = numpy_helper.to_array(node.attribute[0].t)
            if value.dtype == np.int64 and value.size <= 8:
                found[node.output[0]] = value
    return found


def attention_shape(model: onnx.ModelProto) -> tuple[int, int]:
    """(heads, hidden width) of a BERT-style encoder, or (0, 0) where the graph does not
    say: the width is the commonest LayerNormalization scale length; the heads, the
    commonest head count a 4-d reshape names: (heads, head size) whose product is that
    width, or (-1, head size)."""
    sizes = {t.name: int(np.prod(t.dims)) for t in model.graph.initializer}
    widths = collections.Counter(
        sizes[n.input[1]]
        for n in model.graph.node
        if n.op_type == "LayerNormalization" and len(n.input) > 1 and n.input[1] in sizes
    )
    if not widths:
        return 0, 0
    hidden = widths.most_common(1)[0][0]
    constants = _constants(model)
    pairs: collections.Counter[int] = collections.Counter()
    for node in model.graph.node:
        if node.op_type == "Reshape" and node.input[1] in constants:
            dims = [int(d) for d in constants[node.input[1]].reshape(-1)]
        elif node.op_type == "Concat" and len(node.input) == 4:
            tail = [constants.get(name) for name in node.input[2:]]
            dims = [0, 0] + [int(t.reshape(-1)[0]) for t in tail if t is not None and t.size]
        else:
            continue
        if len(dims) != 4 or dims[3] <= 0 or hidden % dims[3]:
            continue
        heads = hidden // dims[3]
        if dims[2] in (-1, heads):  # (heads, head size) or (-1, head size)
            pairs[heads] += 1
    return (pairs.most_common(1)[0][0], hidden) if pairs else (0, 0)


@contextlib.contextmanager
def _optimizer_quiet() -> Iterator[None]:
    """The optimizer's own log lines (a failed head-count guess, each fusion's count)
    kept off the user's terminal."""
    logger = logging.getLogger("onnxruntime.transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def transformer_fused(model: onnx.ModelProto) -> tuple[onnx.ModelProto | None, str]:
    """``model`` with ORT's BERT fusions and a note of what fused, or None and why not
    (no normalization to fuse around, or no fused kernel came out)."""
    if not _NORMS & {n.op_type for n in model.graph.node}:
        return None, "no LayerNormalization: no transformer fusion applies"
    if model.ByteSize() > INLINE_LIMIT:
        return None, "over 2 GB: ONNX Runtime's optimizer reads a model held in one message"
    heads, hidden = attention_shape(model)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the optimizer rewrites the proto it is given
    with _optimizer_quiet():
        fused = optimizer.optimize_model(
            copy,
            model_type="bert",
            num_heads=heads,
            hidden_size=hidden,
            opt_level=0,
            use_gpu=False,
        )
    before = collections.Counter(n.op_type for n in model.graph.node if n.domain)
    after = collections.Counter(n.op_type for n in fused.model.graph.node if n.domain)
    made = {op: after[op] - before[op] for op in FUSED_OPS if after[op] > before[op]}
    if not made:
        return None, "ONNX Runtime's transformer fusions found nothing to fuse"
    return fused.model, "ONNX Runtime's fusions: " + ", ".join(
        f"{n} {op}" for op, n in made.items()
    )
