"""The INT8 options (:class:`QuantizeConfig`), validated once, and the CPU facts they read."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mixprec.core.callables import load_callable
from mixprec.core.config import ConvertConfig, check_budget, check_choice
from mixprec.core.errors import MixprecError
from mixprec.core.graphs import exclude_patterns
from mixprec.core.policy import default_policy
from mixprec.core.readings import user_kinds
from mixprec.int8.params import METHODS
from mixprec.int8.rounding import ROUNDINGS
from mixprec.int8.spec import FULL_RANGE, REDUCED_RANGE, BackendQuantizer, QuantSpec
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import engine_for, runtime_options

__all__ = [
    "DEFAULT_SMOOTH",
    "DYNAMIC_MAC_SHARE",
    "FALLBACKS",
    "MODES",
    "PER_CHANNEL_OPSET",
    "PLACEMENTS",
    "SPEEDS",
    "QuantizeConfig",
    "guard_spellings",
]

#: Precisions of the nodes left out of INT8 (the fallback).
FALLBACKS = ("fp32", "fp16", "bf16")
_ACTIVATIONS = ("auto", "u8", "s8")
#: Per-channel DequantizeLinear (``axis``) needs this ai.onnx opset.
PER_CHANNEL_OPSET = 13
MODES = ("static", "dynamic", "auto")
#: How ops without weights join INT8 (:class:`~mixprec.int8.plan.AnnotateInt8Pass`).
PLACEMENTS = ("chains", "every", "weighted")
#: QuantizeConfig.speed (the margins: :data:`mixprec.int8.speed.SPEED_MARGINS`)
SPEEDS = ("auto", "compete", "off")
#: ``QuantizeConfig.smooth`` unless told otherwise (see its doc).
DEFAULT_SMOOTH: float | str | None = "auto"
#: mode="auto" goes dynamic when weighted MatMul/Gemm hold at least this MAC share.
DYNAMIC_MAC_SHARE = 0.8


def _check_smooth(smooth: object) -> None:
    if smooth is None or smooth == "auto":
        return
    if isinstance(smooth, bool) or not isinstance(smooth, int | float) or not 0 < smooth < 1:
        raise MixprecError(f"smooth must be 'auto', an alpha in (0, 1) or None, not {smooth!r}")


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """The INT8 options, validated.

    Attributes:
        method: activation ranges: "mse" (the clip of least squared quantization error
            over a histogram; the default: on the bench's PP-OCR det it takes the output's
            rel L2 from 0.25 (minmax) to 0.15, rec's top-1 from 0.91 to 0.95), "minmax",
            "entropy" (KL threshold over a histogram) or "percentile" (99.999% of |x|).
        activations: "u8" (asymmetric uint8), "s8" (symmetric int8) or "auto": u8, with
            7-bit weights (reduce_range) on x86 CPUs without VNNI, where u8 x s8 products
            saturate in int16.
        per_channel: per-output-channel weight scales (raises the opset to 13 if needed).
        exclude_nodes: node names or regular expressions kept float.
        shapes: concrete shapes for symbolic input dims.
        fold_batchnorm: fold BatchNormalization into Conv/Gemm first.
        check: hold the result to the full ONNX checker.
        log_dir: folder for the graphs and the report.
        speed: "auto" times candidate placements on this machine (all INT8 nodes; every
            op with an INT8 kernel, as ONNX Runtime's quantize_static places them; without
            depthwise convolutions; only the large Conv/MatMul/Gemm) against the user's
            FP32 model and keeps the fastest, never one slower than FP32 (the model then
            stays float) and only one clearly (5%) faster; "compete" keeps the fastest
            one faster in the median (no majority of rounds asked), for a caller that
            times the result against other candidates itself (``mixprec optimize``);
            "off" quantizes all.
        latency_shapes: input shapes the speed plan times at (the deployment's, e.g. a
            serving batch); by default ``shapes``, else the calibration sample's.
        placement: "chains" (ops without weights join INT8 when an INT8 node feeds them),
            "every" (wherever they have a float input) or "weighted" (only Conv/MatMul/Gemm;
            a MatMul/Gemm output then stays float: MatMulIntegerToFloat, what transformers
            need, whose MatMul outputs hold outliers one INT8 scale cannot); the speed plan
            may choose.
        mode: "static" (calibrated Q/DQ pairs), "dynamic" (MatMul/Gemm weights INT8
            offline, activations quantized per call at run time; no calibration) or
            "auto": dynamic when MatMul/Gemm with constant weights hold >= 80% of the
            Conv/MatMul/Gemm MACs (transformers, whose activation outlier channels one
            static scale cannot hold), else static.
        bias_correction: fold the mean output shift of weight rounding into Conv/Gemm
            biases (static mode; the calibration also averages their inputs' channel means).
        rounding: how INT8 weights are rounded (static mode): "nearest", or "learned":
            AdaRound per Conv/Gemm/MatMul (:mod:`mixprec.int8.rounding`) on input rows
            captured from the first calibration samples, each code up or down to lower
            the layer's output error. Costs a capture and an optimisation per layer.
            "nearest" by default: it lowers each layer's own output error (20-35% on
            held-out rows) but not the models' (all-INT8 per-channel rel L2: PP-OCR cls
            0.124 -> 0.129, det 0.167 -> 0.168, MTCNN O-Net boxes 0.073 -> 0.073; with
            per-tensor weights cls 0.175 -> 0.148 but det 0.408 -> 0.465), at +3 to +28 s
            on 2 cores: at 8 bits the error reaching each layer outweighs its weights'.
        equalize: cross-layer equalization before calibration
            (:class:`~mixprec.int8.equalize.EqualizeLayersPass`): rescale the channels of
            Conv/Gemm pairs so both weights use their INT8 grid alike, with high-bias
            absorption where BatchNormalization statistics exist. True, False or "auto":
            with per-tensor weight scales only (all-INT8 PP-OCR cls per-tensor: rel L2
            0.248 -> 0.156, det 0.457 -> 0.428; per-channel: cls 0.091 -> 0.095 with
            top-1 0.984 -> 0.938, MTCNN's box heads worse either way; docs/guides/quantize.md).
        smooth: SmoothQuant before calibration (:class:`~mixprec.int8.smooth.SmoothQuantPass`):
            divide the outlier channels of MatMul/Gemm activation inputs by per-channel
            scales folded into the producer (a layer norm) or a float ``Mul``, the weight
            rows multiplied by them. "auto" searches the strength alpha per input on the
            calibration samples and smooths only where it lowers the layer's INT8 error;
            a number in (0, 1) is alpha for every input with outlier channels; None: off.
            Needs calibration data.
        fallback: precision of the nodes left out of INT8: "fp32", or "fp16"/"bf16" painted
            by the FP16/BF16 painter around the integer kernels (:mod:`mixprec.pipeline.fallback`).
        guard: the accuracy guard (:func:`mixprec.quantize`): check the INT8 model against
            FP32 on held-out samples and move the sensitive nodes back to float until it
            holds (:mod:`mixprec.checks.outputs`); False warns that nothing is checked.
        guard_drop: the guard's accepted drop of top-1 agreement on class scores
            (agreement >= 1 - drop; None: 0.01) and of equal elements on integer outputs.
        guard_rel_l2: the guard's bound on other outputs' relative L2 (None: 0.1).
        guard_cosine: the cosine to FP32 a row of an embedding must reach (None: 0.99).
        output_kinds: how the guard reads outputs, by name, in place of its own reading
            (:func:`mixprec.core.readings.user_kinds`: ``{"output0": "detection"}``).
        accept_unconfirmed: keep an INT8 result whose agreement checks pass on held-out
            rows too few to confirm them (their 95% lower bound under the budget); by
            default such a result is not a pass: the input is written unchanged and the
            last line says how many rows would confirm it.
        metric: the user's own measure instead of the per-output checks: a callable
            ``score(fp32_outputs, int8_outputs[, labels]) -> float`` (one dict per
            held-out sample; ``labels``, when it takes them: the eval data's arrays that
            are not model inputs; higher is better) or ``"MODULE:FUNCTION"`` /
            ``"FILE.py:FUNCTION"``.
        metric_budget: the lowest accepted score of ``metric`` (required with it).
        runtime: the engine the speed plan times placements in and the guard runs the
            result in (the deployment's): ONNX Runtime by default, or OpenVINO
            (:class:`~mixprec.runtime.engine.RuntimeOptions`, or its name).
    """

    method: str = "mse"
    activations: str = "auto"
    per_channel: bool = True
    exclude_nodes: tuple[str, ...] = ()
    shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    fold_batchnorm: bool = True
    check: bool = True
    log_dir: Path | None = None
    speed: str = "auto"
    latency_shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    placement: str = "chains"
    mode: str = "auto"
    fallback: str = "fp32"
    bias_correction: bool = False
    rounding: str = "nearest"
    equalize: bool | str = "auto"
    smooth: float | str | None = DEFAULT_SMOOTH
    guard: bool = True
    guard_drop: float | None = None
    guard_rel_l2: float | None = None
    guard_cosine: float | None = None
    output_kinds: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    accept_unconfirmed: bool = False
    runtime: RuntimeOptions = dataclasses.field(default_factory=RuntimeOptions)
    metric: Any = None
    metric_budget: float | None = None

    def __post_init__(self) -> None:
        if self.metric is None and self.metric_budget is not None:
            raise MixprecError("metric_budget (--metric-budget) needs metric (--metric)")
        if self.metric is not None:
            if isinstance(self.metric, str):
                object.__setattr__(self, "metric", load_callable(self.metric))
            if not callable(self.metric):
                raise MixprecError(
                    f"metric must be a callable or 'MODULE:FUNCTION', not {self.metric!r}"
                )
            if self.metric_budget is None:
                raise MixprecError("metric needs metric_budget (--metric-budget): its lowest score")
            if isinstance(self.metric_budget, bool) or not isinstance(
                self.metric_budget, int | float
            ):
                raise MixprecError(
                    f"metric_budget (the lowest accepted score of metric) must be a number, "
                    f"not {self.metric_budget!r}"
                )
        object.__setattr__(self, "runtime", runtime_options(self.runtime))
        object.__setattr__(self, "output_kinds", user_kinds(self.output_kinds))
        if self.log_dir is not None:
            if not isinstance(self.log_dir, str | os.PathLike):
                raise MixprecError(f"log_dir must be a path, not {type(self.log_dir).__name__}")
            object.__setattr__(self, "log_dir", Path(self.log_dir))
        for name in ("guard_drop", "guard_rel_l2", "guard_cosine"):
            object.__setattr__(self, name, check_budget(name, getattr(self, name)))
        for name, choices in (
            ("fallback", FALLBACKS),
            ("mode", MODES),
            ("placement", PLACEMENTS),
            ("speed", SPEEDS),
            ("rounding", ROUNDINGS),
            ("method", METHODS),
            ("activations", _ACTIVATIONS),
        ):
            check_choice(name, getattr(self, name), choices)
        if not isinstance(self.equalize, bool) and self.equalize != "auto":
            raise MixprecError(f"equalize must be True, False or 'auto', not {self.equalize!r}")
        _check_smooth(self.smooth)
        object.__setattr__(self, "exclude_nodes", exclude_patterns(self.exclude_nodes))

    @property
    def equalizes(self) -> bool:
        """Whether cross-layer equalization runs (``equalize`` with "auto" resolved)."""
        if self.equalize == "auto":
            return not self.per_channel and self.mode != "dynamic"
        return bool(self.equalize)

    @property
    def unsigned(self) -> bool:
        return self.activations != "s8"

    @property
    def reduce_range(self) -> bool:
        if self.activations != "auto":
            return False
        return engine_for(RuntimeOptions()).saturates_int8()  # ORT's QDQ kernels

    def quantizer(self) -> BackendQuantizer:
        """The backend quantizer these options ask for: ONNX Runtime's CPU QDQ kernels,
        activations in uint8 (int8 with ``activations="s8"``) by :attr:`method`, weights
        symmetric int8 (per channel with :attr:`per_channel`; 7-bit where the CPU's
        kernels saturate, :attr:`reduce_range`)."""
        dtype = "uint8" if self.unsigned else "int8"
        qmax = REDUCED_RANGE if self.reduce_range else FULL_RANGE
        return BackendQuantizer(
            QuantSpec(dtype, method=self.method),
            QuantSpec("int8", qmax=qmax, per_channel=self.per_channel),
        )

    def base(self) -> ConvertConfig:
        """The shared stages' configuration (prepare, calibrate, check)."""
        return ConvertConfig(
            policy=default_policy("fp16"),
            observer="minmax" if self.method == "minmax" else "histogram",
            shapes=self.shapes,
            fold_batchnorm=self.fold_batchnorm,
            check=self.check,
            upgrade_opset=False,
            log_dir=self.log_dir,
        )


def guard_spellings(options: dict[str, Any]) -> dict[str, Any]:
    """``max_drop`` / ``max_rel_l2`` / ``min_cosine``, the CLI's ``--max-drop`` /
    ``--max-rel-l2`` / ``--min-cosine``, are the guard's budgets (``guard_drop`` /
    ``guard_rel_l2`` / ``guard_cosine``): one meaning for each name."""
    spellings = (
        ("max_drop", "guard_drop"),
        ("max_rel_l2", "guard_rel_l2"),
        ("min_cosine", "guard_cosine"),
    )
    for short, field in spellings:
        if short not in options:
            continue
        value = options.pop(short)
        if options.get(field) is not None and value is not None:
            raise MixprecError(f"give {short}= or {field}=, not both (they are one option)")
        if value is not None:
            options[field] = value
    return options
