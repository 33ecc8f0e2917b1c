"""Run a float16/bfloat16 model on ONNX Runtime's CPU provider by emulation.

ORT's CPU provider has almost no bfloat16 kernels, so a bf16 model is measured through
an FP32 stand-in: every low-precision value becomes float32, and each node output that
was low precision is rounded through its dtype with Cast(to=LOW) -> Cast(to=FLOAT).
Arithmetic inside an op then happens in FP32; what is emulated is the storage of every
tensor in the low dtype. mixprec ships this transformation as the public pass
``mixprec.EmulateLowPrecisionPass``, which bench.main uses (and names in the report).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
import onnx_ir as ir

import mixprec


def _emulate(proto: onnx.ModelProto) -> onnx.ModelProto:
    model = ir.from_proto(proto)
    mixprec.EmulateLowPrecisionPass()(model)
    return ir.to_proto(model)


def emulator() -> tuple[Callable[[onnx.ModelProto], onnx.ModelProto], str]:
    """The emulation function to use and its name for the report."""
    return _emulate, "mixprec.EmulateLowPrecisionPass"
