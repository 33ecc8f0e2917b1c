"""``mixprec.validate``: compare a converted model with its FP32 original in ONNX Runtime."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from mixprec._errors import MixprecError
from mixprec._io import load_model

__all__ = ["validate"]

ModelLike = str | os.PathLike[str] | onnx.ModelProto | ir.Model


def _proto(model: ModelLike) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, ir.Model):
        return ir.to_proto(model)
    if isinstance(model, str | os.PathLike):
        return ir.to_proto(load_model(model))
    raise MixprecError(f"expected a path or a model, not {type(model).__name__}")


def validate(
    original: ModelLike,
    converted: ModelLike,
    *,
    inputs: Mapping[str, np.ndarray] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    rtol: float | None = None,
    atol: float = 1e-3,
    mode: str = "auto",
    seed: int = 0,
):
    """Run both models on the same inputs and compare every output.

    Args:
        original: the FP32 model.
        converted: the mixed-precision model.
        inputs: feeds by input name; generated from the signature when omitted (symbolic
            dims then need ``shapes``).
        shapes: concrete shapes for symbolic input dims.
        rtol: max relative L2 error per output (default: 1e-2 fp16, 8e-2 bf16).
        atol: max abs error accepted instead where the reference is near zero.
        mode: "ort" runs the converted model as is, "emulated" runs an FP32 model that
            rounds every low-precision tensor through the low dtype (for runtimes without
            bf16 kernels), "auto" tries "ort" and falls back to "emulated".

    Returns:
        A ``ValidationReport`` (``.passed``, ``.outputs``, ``.kind``, ``.format_table()``).

    Example:
        >>> report = mixprec.validate("m.onnx", "m_fp16.onnx")      # doctest: +SKIP
        >>> report.passed                                            # doctest: +SKIP
        True
    """
    from mixprec import _runtime

    if mode not in ("auto", "ort", "emulated"):
        raise MixprecError(f"unknown validation mode {mode!r}: use auto, ort or emulated")
    ref_model = _proto(original)
    new_model = _proto(converted)
    if inputs is None:
        feeds, _notes = _runtime.make_inputs(ref_model, shapes=shapes, seed=seed)
    else:
        feeds = dict(inputs)
    return _runtime.validate_models(ref_model, new_model, feeds, rtol=rtol, atol=atol, mode=mode)
