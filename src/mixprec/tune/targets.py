"""The two kinds of target :func:`mixprec.tune` searches: FP16/BF16 and INT8.

Each builds the pipeline for a set of nodes moved back to float (the policy's node
exclusions), names the candidate nodes of an annotated model with their MACs, measures
a model's low-precision MAC share, and rounds tensors for the sensitivity run.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.calibrate.measure import MACS, calibration_of
from mixprec.core.config import ConvertConfig
from mixprec.core.errors import MixprecError
from mixprec.core.graphs import UniqueNames, iter_nodes
from mixprec.core.ops import parse_dtype, weight_out_axis
from mixprec.int8.config import MODES, PER_CHANNEL_OPSET, QuantizeConfig
from mixprec.int8.params import activation_qparams, quantize_weight
from mixprec.int8.plan import int8_decision, runs_int8, weight_index
from mixprec.int8.spec import BackendQuantizer, QuantSpec
from mixprec.passes.emulate import EmulateLowPrecisionPass
from mixprec.pipeline.quantize import QuantizePipeline
from mixprec.pipeline.stages import Pipeline
from mixprec.precision.paint import Precision, painted
from mixprec.runtime.engine import Engine
from mixprec.tune.sensitivity import CastRounder, Rounder

__all__ = ["FloatTarget", "Int8Target", "QdqRounder", "make_target"]


def _escaped(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(re.escape(n) for n in names)


class FloatTarget:
    """FP16/BF16: candidates are the nodes painted low precision."""

    int8 = False

    def __init__(self, target: str | None, options: Mapping[str, Any], mode: str) -> None:
        self.config = ConvertConfig.resolve(target, **dict(options))
        self.name = self.config.target
        self.mode = mode

    def pipeline(self, excluded: Sequence[str], data: Any = None, *, check: bool) -> Pipeline:
        policy = self.config.policy.with_changes(exclude_nodes=_escaped(excluded))
        config = self.config.replace(policy=policy, check=check and self.config.check)
        return Pipeline(config, calibration_data=data)

    @staticmethod
    def candidates(model: ir.Model) -> dict[str, tuple[str, int]]:
        return {
            node.name or "": (node.op_type, int(node.meta.get(MACS, 0)))
            for node, d in painted(model)
            if d.precision is Precision.LOW
        }

    @staticmethod
    def low_mac_share(model: ir.Model) -> float:
        total = low = 0
        for node, d in painted(model):
            macs = int(node.meta.get(MACS, 0))
            total += macs
            low += macs if d.precision is Precision.LOW else 0
        return low / total if total else 0.0

    def rounder(self, model: ir.Model):
        low = self.config.policy.target_type
        return lambda graph, names: CastRounder(graph, names, low)

    def runnable(self, model: ir.Model, engine: Engine) -> tuple[onnx.ModelProto, str]:
        """The model (a disposable candidate, changed in place) to run in ``engine``, and
        the graph optimizations to run it with ("basic", or "off" for an emulation).

        As is in the modes that name a runtime ("ort", "openvino"), unless the target is
        bfloat16 and the engine refuses bf16 models (ONNX Runtime's CPU provider lacks
        bfloat16 kernels); OpenVINO runs bf16 on real kernels where the CPU has them.
        Otherwise emulated in float32 (every low tensor rounded through the low dtype):
        for float16 ops ONNX Runtime's CPU provider lacks, it computes in float32 and
        drops the rounding between them, hiding errors a GPU would show.
        """
        as_is = self.mode != "emulated" and (self.name != "bfloat16" or not engine.refuses_bf16())
        if as_is:
            return ir.to_proto(model), "basic"
        return ir.to_proto(EmulateLowPrecisionPass()(model).model), "off"


class Int8Target:
    """INT8 QDQ: candidates are the Conv/MatMul/Gemm nodes planned INT8 (the other INT8
    ops follow them: they stay in the integer domain only when an INT8 node feeds them)."""

    int8 = True
    name = "int8"

    def __init__(self, options: Mapping[str, Any]) -> None:
        opts = dict(options)
        opts.setdefault("speed", "off")  # placement by accuracy here, not by timing
        try:
            self.qconfig = QuantizeConfig(**opts)
        except TypeError as exc:
            raise MixprecError(f"tune: {exc}") from None

    def pipeline(self, excluded: Sequence[str], data: Any = None, *, check: bool) -> Pipeline:
        q = dataclasses.replace(
            self.qconfig,
            exclude_nodes=self.qconfig.exclude_nodes + _escaped(excluded),
            check=check and self.qconfig.check,
        )
        return QuantizePipeline(q, calibration_data=data)

    @staticmethod
    def candidates(model: ir.Model) -> dict[str, tuple[str, int]]:
        return {
            node.name or "": (node.op_type, int(node.meta.get(MACS, 0)))
            for node in model.graph
            if (d := int8_decision(node)) is not None and d.int8 and d.role == "weighted"
        }

    @staticmethod
    def low_mac_share(model: ir.Model) -> float:
        total = low = 0
        for node in iter_nodes(model.graph):
            macs = int(node.meta.get(MACS, 0))
            total += macs
            low += macs if runs_int8(node) else 0
        return low / total if total else 0.0

    def rounder(self, model: ir.Model):
        stats = calibration_of(model).stats
        quantizer = self.qconfig.quantizer()
        return lambda graph, names: QdqRounder(graph, names, stats, quantizer)

    @staticmethod
    def runnable(model: ir.Model, engine: Engine) -> tuple[onnx.ModelProto, str]:
        # as deployed: the engine fuses Q/DQ pairs into integer kernels, whose rounding
        # the accuracy guard grades; at the basic level they ran as DQ -> float -> Q, so
        # the search ranked nodes by an error the gate never measured
        return ir.to_proto(model), "all"


class QdqRounder(Rounder):
    """INT8 emulation: activations through QuantizeLinear -> DequantizeLinear at their
    calibrated scale; weights replaced by their (per-channel) fake-quantized values, as the
    specs annotate recorded on each INT8 node say (an activation: those of an INT8 node
    that reads or writes it; the backend quantizer's where no INT8 node does)."""

    def __init__(
        self,
        graph: ir.Graph,
        names: UniqueNames,
        stats: Mapping[str, Any],
        quantizer: BackendQuantizer,
    ):
        super().__init__(graph, names)
        self.stats = stats
        self.quantizer = quantizer

    def _const(self, base: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=self.fresh(base), const_value=ir.tensor(array))
        value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
        value.shape = ir.Shape(array.shape)
        self.graph.register_initializer(value)
        return value

    def _specs(self, node: ir.Node) -> tuple[QuantSpec, QuantSpec | None]:
        """The specs annotate recorded on ``node``; the quantizer's where it recorded none."""
        decision = int8_decision(node)
        if decision is not None and decision.int8 and decision.activation is not None:
            return decision.activation, decision.weight
        return self.quantizer.specs(node)

    def _round(self, value: ir.Value, weight_of: ir.Node | None) -> ir.Value:
        base = f"{value.name}__tune_q"
        if weight_of is not None:
            index = weight_index(weight_of)
            tensor = value.const_value
            if index is None or weight_of.inputs[index] is not value or tensor is None:
                return value  # biases and other constants stay float
            w = tensor.numpy().astype(np.float32)
            spec = self._specs(weight_of)[1]
            assert spec is not None  # weight_index found a weighted layer's weight
            axis = weight_out_axis(weight_of, w.ndim) if spec.per_channel else None
            found = quantize_weight(w, axis, qmax=spec.qmax)
            if isinstance(found, str):
                return value
            qw, wparams = found
            if axis is None or self.graph.opset_imports.get("", 0) >= PER_CHANNEL_OPSET:
                # int8 codes dequantized in the run, the same values: a quarter of the
                # bytes a float copy of every weight held (MiniLM's guard repair)
                attrs = {"axis": axis} if axis is not None else {}
                codes = self._const(f"{base}_int8", qw)
                scale = self._const(f"{base}_scale", wparams.scale)
                zero = self._const(f"{base}_zp", wparams.zero_point)
                return self._append("DequantizeLinear", [codes, scale, zero], base, **attrs)
            factor = np.expand_dims(wparams.scale, [d for d in range(w.ndim) if d != axis])
            return self._const(base, (qw.astype(np.float32) * factor).astype(np.float32))
        stats = self.stats.get(value.name or "")
        if stats is None:
            return value
        nodes = [u.node for u in value.uses()] + [value.producer()]
        owner = next((n for n in nodes if n is not None and runs_int8(n)), None)
        spec = self.quantizer.activation if owner is None else self._specs(owner)[0]
        qparams = activation_qparams(stats, spec.method, spec.unsigned)
        if isinstance(qparams, str):
            return value
        scale = self._const(f"{base}_scale", np.asarray(qparams.scale, np.float32))
        zero = self._const(f"{base}_zp", np.asarray(qparams.zero_point))
        quantized = self._append("QuantizeLinear", [value, scale, zero], base)
        return self._append("DequantizeLinear", [quantized, scale, zero], base)


#: How fp16/bf16 candidates run: emulated in FP32, as is in ONNX Runtime, or as is in
#: OpenVINO (real bf16 kernels on CPUs with avx512_bf16/AMX).
FLOAT_MODES = ("emulated", "ort", "openvino")


def make_target(
    target: str | None, options: Mapping[str, Any], mode: str = "emulated"
) -> FloatTarget | Int8Target:
    """The target of a tuning run. ``mode`` is how fp16/bf16 candidates run ("emulated" or
    "ort"); for int8, whose candidates always run as is, it may name the INT8 mode."""
    if target is not None and not isinstance(target, str):
        raise TypeError(f"target must be 'fp16', 'bf16' or 'int8', not {type(target).__name__}")
    int8 = target is not None and parse_dtype(target, what="target") == "int8"
    if int8 and mode in MODES:
        return Int8Target({**options, "mode": mode})
    if mode not in FLOAT_MODES:
        allowed = "'emulated', 'ort' or 'openvino'"
        if int8:
            allowed += f" (or an INT8 mode: {', '.join(MODES)})"
        raise MixprecError(f"mode must be {allowed}, not {mode!r}")
    if int8:
        return Int8Target(options)
    return FloatTarget(target, options, mode)  # None: MIXPREC_DTYPE, else float16
