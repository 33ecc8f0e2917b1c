"""Run a float16/bfloat16 model on ONNX Runtime's CPU provider by emulation.

ORT's CPU provider has almost no bfloat16 kernels, so a bf16 model is measured through
an FP32 stand-in: every low-precision value becomes float32, and each node output that
was low precision is rounded through its dtype with Cast(to=LOW) -> Cast(to=FLOAT).
Arithmetic inside an op then happens in FP32; what is emulated is the storage of every
tensor in the low dtype. mixprec ships this transformation as
``mixprec.EmulateLowPrecisionPass``; bench.py uses its proto wrapper
``mixprec._emulate.emulate_low_precision`` (and records that name in the report).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from mixprec._emulate import emulate_low_precision


def emulator() -> tuple[Callable[[onnx.ModelProto], onnx.ModelProto], str]:
    """The emulation function to use and its name for the report."""
    return emulate_low_precision, "mixprec._emulate.emulate_low_precision"
