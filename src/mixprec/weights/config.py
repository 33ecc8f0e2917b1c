"""The weight-only options (:class:`WeightsConfig`), validated once, and the CPU facts
that choose ``accuracy_level``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mixprec.core.config import check_budget, check_choice
from mixprec.core.errors import MixprecError
from mixprec.core.graphs import exclude_patterns
from mixprec.runtime.cpu import CpuFeatures
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import ENGINES, engine_for, runtime_options
from mixprec.weights.blocks import BITS, BLOCK_SIZES, BlockSpec
from mixprec.weights.methods import AUTO, METHODS

__all__ = [
    "ACCURACY_LEVELS",
    "INT8_ONLY",
    "PRECISIONS",
    "LayerChoice",
    "WeightsConfig",
    "default_accuracy_level",
    "parse_weights",
    "weights_config",
]

#: What a weight can become: 4 or 8 bits, or stay float.
PRECISIONS = ("int4", "int8", "float")
#: ``MatMulNBits`` accuracy levels: 0 unset (float compute), 1 fp32, 2 fp16, 3 bf16,
#: 4 int8 (the activations are quantized per block to int8 inside the kernel).
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
_BITS = {"int4": 4, "int8": 8}


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One node's precision chosen from outside the config's defaults (the mixed-bits
    pass fills a map of these by sensitivity), and why."""

    precision: str
    reason: str

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise MixprecError(
                f"a layer's precision is one of {', '.join(PRECISIONS)}, not {self.precision!r}"
            )


def parse_weights(text: str | int) -> int:
    """``"int4"``/``"int8"`` (also ``4``, ``8``, ``"4"``) as the bit count."""
    key = str(text).strip().lower()
    key = key if key.startswith("int") else f"int{key}"
    if key not in _BITS:
        raise MixprecError(f"weights must be int4 or int8, not {text!r}")
    return _BITS[key]


@dataclasses.dataclass(frozen=True)
class WeightsConfig:
    """The weight-only options, validated.

    Attributes:
        bits: 4 or 8: the bits of every MatMul weight the other fields do not set.
        block_size: weights per scale along the input dimension K: 16, 32 (default), 64,
            128 or 256 (ONNX Runtime's blocks; K need not divide, the last block is padded).
        symmetric: a fixed zero point per block (2**(bits-1)) rather than one fitted to
            the block's range. Default False: on the 37 linear layers of all-MiniLM-L6-v2,
            asymmetric blocks give 7% less output error at 4 bits (block 32: rel L2 0.083
            against 0.089) and 12% less at 8 bits, at the same speed within noise.
        method: "rtn" (round to nearest) or "auto": the best registered method that the
            data given allows (:mod:`mixprec.weights.methods`).
        ratio: the share of linear-layer weights left at 4 bits when ``bits`` is 4 (0 to
            1), the rest going to 8 bits by sensitivity (:mod:`mixprec.weights.mixed_bits`);
            None (default): the layers whose score stands out go to 8 bits, within a size
            budget of 90% of the linear weights at 4 bits, which the guard's repair may
            spend and never exceed.
        max_size: a size budget instead of ``ratio``: the parameter bytes at most this
            share of the float model's (embeddings included), the 4/8-bit mix chosen by
            sensitivity to fill it (with ``bits`` 4).
        accuracy_level: ``MatMulNBits``' compute: 0 (float) or 4 (activations quantized to
            int8 per block inside the kernel; 1-3 as ONNX Runtime defines them). None
            chooses by this CPU (:func:`default_accuracy_level`).
        lm_head: the output projection's precision ("int8" by default: a small LM loses
            the most at 4 bits there), "int4" or "float".
        embeddings: embedding tables (Gather of a constant table): "int8" (default),
            "int4" or "float".
        exclude_nodes: node names or regular expressions kept float.
        layers: a precision per node name (:class:`LayerChoice`, or one of
            :data:`PRECISIONS`), over the defaults above; exclusions still win.
        shapes: concrete shapes for symbolic input dims (the checks' generated inputs).
        guard: run the model on the samples and compare its outputs with FP32 (ONNX
            Runtime): the report reads each output as rows of answers, as the INT8 guard
            does (:mod:`mixprec.repair.weights_guard`), with its rel L2 beside them.
        guard_drop: a share of rows (top-1, rows at the cosine bound, neighbours, ...)
            below 1 - drop fails the check (None: reported against the INT8 defaults,
            not enforced).
        guard_rel_l2: a rel L2 (the worst channel's) above this fails the check (None:
            not enforced).
        guard_kl: a language model's mean next-token KL(FP32 || quantized) in nats above
            this fails the language-model guard (None: its default, 0.03).
        guard_perplexity: a language model's accepted relative perplexity rise on the
            check text (None: its default, 0.03). A language model's ``guard_drop``
            bounds its top-1 next-token agreement (None: 0.2).
        check: hold the result to the ONNX checker.
        log_dir: folder for the graphs and the report.
        runtime: the engine options the checks run with (ONNX Runtime; its threads).
        stream: quantize in bounded memory, the weights read from the memory-mapped data
            files one at a time and the FP32 reference run in pieces
            (:mod:`mixprec.pipeline.streamed`); None (default): when the external data is
            over 2 GB. A streamed run ranks the guard's repair by the weights' own error
            and cannot run GPTQ.
    """

    bits: int = 4
    block_size: int = 32
    symmetric: bool = False
    method: str = AUTO
    ratio: float | None = None
    max_size: float | None = None
    accuracy_level: int | None = None
    lm_head: str = "int8"
    embeddings: str = "int8"
    exclude_nodes: tuple[str, ...] = ()
    layers: Mapping[str, LayerChoice] = dataclasses.field(default_factory=dict)
    shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    guard: bool = True
    guard_drop: float | None = None
    guard_rel_l2: float | None = None
    guard_kl: float | None = None
    guard_perplexity: float | None = None
    check: bool = True
    log_dir: Path | None = None
    runtime: RuntimeOptions = dataclasses.field(default_factory=RuntimeOptions)
    stream: bool | None = None

    def __post_init__(self) -> None:
        _check_int("bits", self.bits, BITS, "4 or 8")
        sizes = ", ".join(str(b) for b in BLOCK_SIZES)
        _check_int("block_size", self.block_size, BLOCK_SIZES, f"a power of two: {sizes}")
        if not isinstance(self.symmetric, bool):
            raise MixprecError(f"symmetric must be True or False, not {self.symmetric!r}")
        if self.stream is not None and not isinstance(self.stream, bool):
            raise MixprecError(f"stream must be True, False or None, not {self.stream!r}")
        if self.method != AUTO and self.method not in METHODS:
            names = ", ".join([AUTO, *sorted(METHODS)])
            raise MixprecError(f"weight method must be one of {names}, not {self.method!r}")
        if self.accuracy_level is not None:
            _check_int("accuracy_level", self.accuracy_level, ACCURACY_LEVELS, "0 to 4")
        ratio = self.ratio
        if ratio is not None and (
            isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1
        ):
            raise MixprecError(f"ratio (weights at 4 bits) must lie in [0, 1], not {ratio!r}")
        _check_max_size(self.max_size, self.bits, ratio)
        for name in ("lm_head", "embeddings"):
            check_choice(name, getattr(self, name), PRECISIONS)
        object.__setattr__(self, "exclude_nodes", exclude_patterns(self.exclude_nodes))
        object.__setattr__(self, "layers", _layer_choices(self.layers))
        object.__setattr__(self, "shapes", {k: tuple(v) for k, v in self.shapes.items()})
        for name, high in (
            ("guard_drop", 1.0),
            ("guard_rel_l2", 1.0),
            ("guard_kl", 10.0),
            ("guard_perplexity", 10.0),
        ):
            object.__setattr__(self, name, check_budget(name, getattr(self, name), high))
        if self.log_dir is not None:
            object.__setattr__(self, "log_dir", Path(self.log_dir))
        object.__setattr__(self, "runtime", runtime_options(self.runtime))
        if not ENGINES[self.runtime.name].runs_contrib_ops():
            raise MixprecError(
                f"weight-only models use ONNX Runtime's contrib ops (MatMulNBits): runtime "
                f"{self.runtime.name!r} cannot run them; use ort"
            )

    @property
    def precision(self) -> str:
        """The default precision of a MatMul weight: "int4" or "int8"."""
        return f"int{self.bits}"

    def spec(self, precision: str) -> BlockSpec:
        """The block spec of a weight going to ``precision`` ("int4" or "int8")."""
        return BlockSpec(_BITS[precision], self.block_size, self.symmetric)

    def level(self, bits: int) -> tuple[int, str]:
        """The accuracy level of a ``bits``-bit MatMulNBits, and why."""
        if self.accuracy_level is not None:
            return self.accuracy_level, f"{self.accuracy_level} (as asked)"
        return default_accuracy_level(bits)


def _check_int(name: str, value: Any, allowed: tuple[int, ...], what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
        raise MixprecError(f"{name} must be {what}, not {value!r}")


def _check_max_size(max_size: Any, bits: int, ratio: float | None) -> None:
    if max_size is None:
        return
    if isinstance(max_size, bool) or not isinstance(max_size, int | float) or not 0 < max_size <= 1:
        raise MixprecError(
            f"max size (a share of the float size) must lie in (0, 1], not {max_size!r}"
        )
    if ratio is not None:
        raise MixprecError("give a size budget (max size, bits per weight) or ratio, not both")
    if bits != 4:
        raise MixprecError("a size budget chooses the 4/8-bit mix of --weights int4, not int8")


def _layer_choices(layers: Mapping[str, LayerChoice | str]) -> dict[str, LayerChoice]:
    if not isinstance(layers, Mapping):
        raise MixprecError("layers must map node names to int4, int8 or float")
    return {
        str(name): choice if isinstance(choice, LayerChoice) else LayerChoice(choice, "layers=")
        for name, choice in layers.items()
    }


def default_accuracy_level(bits: int, cpu: CpuFeatures | None = None) -> tuple[int, str]:
    """``accuracy_level`` for ``bits``-bit weights on this CPU (or ``cpu``), and why: what
    ONNX Runtime, the engine that runs ``MatMulNBits``, says
    (:meth:`~mixprec.runtime.engine.Engine.nbits_accuracy_level`)."""
    return engine_for(RuntimeOptions()).nbits_accuracy_level(bits, cpu)


#: :func:`mixprec.quantize` options of INT8 only; with ``weights=`` they have nothing to
#: act on and are refused.
INT8_ONLY = (
    "method",
    "activations",
    "per_channel",
    "mode",
    "placement",
    "speed",
    "latency_shapes",
    "fallback",
    "bias_correction",
    "rounding",
    "equalize",
    "smooth",
    "fold_batchnorm",
    "guard_cosine",
    "min_cosine",
    "metric",
    "metric_budget",
)


def weights_config(weights: str | int | WeightsConfig, options: dict[str, Any]) -> WeightsConfig:
    """The config of a ``weights=`` call: ``weights`` (a bit width or a config) with
    ``options`` (:class:`WeightsConfig` fields; ``weight_method`` is ``method``)."""
    options = dict(options)
    given = sorted(k for k in INT8_ONLY if k in options)
    if given:
        hint = "; the weight method is weight_method=" if "method" in given else ""
        verb = "does" if len(given) == 1 else "do"
        raise MixprecError(
            f"with weights=, {', '.join(f'{k}=' for k in given)} {verb} not apply (INT8 "
            f"only: weight-only quantization leaves activations float){hint}"
        )
    if "weight_method" in options:
        options["method"] = options.pop("weight_method")
    try:
        if isinstance(weights, WeightsConfig):
            return dataclasses.replace(weights, **options)
        return WeightsConfig(bits=parse_weights(weights), **options)
    except TypeError as exc:
        raise MixprecError(f"quantize(weights=...): {exc}") from None
