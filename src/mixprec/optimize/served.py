"""Ratios that hold where the model is served: an OpenVINO winner's input dims written
static at the shape it was timed at.

mixprec's OpenVINO engine reshapes a model to the shape it is fed before it compiles, so
optimize times each OpenVINO candidate compiled for one static shape. OpenVINO compiling
the written file as it stands (``core.compile_model("out.onnx")``) keeps the dims the file
leaves symbolic dynamic, and runs generic kernels for them: PP-OCR's text-direction
classifier (``[-1, 3, ?, ?]``) timed 0.74x ONNX Runtime reshaped, and 1.07x compiled
plainly at the same shape (2026-12-01, an AVX2 EPYC). The written file therefore carries
the timed shape where the samples agree with it (or the user named it with ``--shape``),
and the last line says which dims were fixed, or why they were not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.passes.branches import FoldStaticIfsPass

__all__ = ["agreed_shapes", "folded_ifs", "symbolic_dims", "written_static"]


def symbolic_dims(model: onnx.ModelProto, names: Sequence[str]) -> dict[str, list[int]]:
    """The positions of the dims of the graph inputs ``names`` that have no fixed value."""
    found: dict[str, list[int]] = {}
    for value in model.graph.input:
        if value.name not in names or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        loose = [k for k, d in enumerate(dims) if not d.HasField("dim_value")]
        if loose:
            found[value.name] = loose
    return found


def written_static(
    model: onnx.ModelProto,
    timed: Mapping[str, Sequence[int]],
    held: Sequence[Mapping[str, Any]],
    named: bool,
) -> tuple[onnx.ModelProto, str]:
    """An OpenVINO winner as it is written, and the clause the last line adds.

    Its symbolic input dims are fixed at ``timed`` (the shapes the candidates were timed
    at) when the user ``named`` them (``--shape``) or every held-out sample in ``held``
    has them; otherwise they stay symbolic, and the clause says the ratio then holds only
    where the model is reshaped first. A model with no symbolic input dims is returned
    as it is, with no clause."""
    loose = symbolic_dims(model, list(timed))
    if not loose:
        return model, ""
    at = ", ".join(f"{k} {list(v)}" for k, v in timed.items() if k in loose)
    agreed = all(
        list(np.shape(sample[k])) == list(timed[k]) for sample in held for k in loose if k in sample
    )
    if not (named or agreed):
        return model, (
            f"; its input dims stay dynamic (the samples differ from the timed {at}): "
            "OpenVINO compiling the file as it stands runs generic kernels, and the ratio "
            "holds where it is reshaped first, as mixprec's runtime does (--shape writes "
            "them static)"
        )
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for value in out.graph.input:
        for k in loose.get(value.name, []):
            value.type.tensor_type.shape.dim[k].dim_value = int(timed[value.name][k])
    return out, (
        f"; input dims written static at {at}, the shape it was timed at (OpenVINO "
        "compiles dims left dynamic into slower generic kernels; --shape names another)"
    )


def agreed_shapes(
    timed: Mapping[str, np.ndarray], samples: Iterable[Mapping[str, Any]]
) -> dict[str, list[int]]:
    """The shapes of ``timed`` (the feeds candidates are timed on) where every sample has
    them, else none: a model fixed at one shape must still run every sample it is
    checked on."""
    shapes = {k: [int(d) for d in np.shape(v)] for k, v in timed.items()}
    for sample in samples:
        if any(k in sample and list(np.shape(sample[k])) != v for k, v in shapes.items()):
            return {}
    return shapes


def folded_ifs(
    model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]
) -> tuple[onnx.ModelProto | None, str]:
    """The model with its input dims static at ``shapes`` and the Ifs those shapes decide
    folded (:class:`~mixprec.passes.branches.FoldStaticIfsPass`), as OpenVINO's ONNX reader
    needs them, and a line saying so; ``(None, "")`` where no If folds."""
    if not shapes or not any(n.op_type == "If" for n in model.graph.node):
        return None, ""
    work = ir.from_proto(model)
    for value in work.graph.inputs:
        if value.name is not None and value.name in shapes and value.shape is not None:
            value.shape = ir.Shape(list(shapes[value.name]))
    result = FoldStaticIfsPass().call(work)
    if not result.folded:
        return None, ""
    at = ", ".join(f"{k} {list(v)}" for k, v in shapes.items())
    return ir.to_proto(work), (
        f"OpenVINO's candidates run the input with {len(result.folded)} If(s) folded at "
        f"{at}, its dims written static there (OpenVINO converts no If whose branches "
        "differ in rank; exact at this shape)"
    )
