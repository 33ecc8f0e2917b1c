"""mixprec: FP32 ONNX models to FP16/BF16 mixed precision.

Example:
    >>> import mixprec
    >>> result = mixprec.convert("model.onnx", "fp16")          # doctest: +SKIP
    >>> result.save("model_fp16.onnx")                           # doctest: +SKIP
    >>> print(result.report.format_summary())                    # doctest: +SKIP
"""

from __future__ import annotations

# isort: off
import mixprec.runtime.quiet  # noqa: F401  (first: ONNX Runtime logs to stderr while imported)

# isort: on

from mixprec.api.convert import convert, inspect
from mixprec.api.optimize import optimize
from mixprec.api.quantize import quantize
from mixprec.api.tune import tune
from mixprec.api.validate import validate
from mixprec.batch.results import BatchResult
from mixprec.batch.run import batch
from mixprec.checks.validate import ValidationReport
from mixprec.core.config import ConvertConfig
from mixprec.core.errors import InternalError, MixprecError
from mixprec.core.policy import (
    DEFAULT_LISTS,
    RULES,
    OpClass,
    OpRule,
    Policy,
    default_policy,
    register_rule,
)
from mixprec.core.version import __version__ as __version__
from mixprec.int8.config import QuantizeConfig
from mixprec.optimize.result import OptimizeResult
from mixprec.passes.emulate import EmulateLowPrecisionPass, EmulateLowPrecisionResult
from mixprec.pipeline.convert import ConversionResult
from mixprec.pipeline.report import NodeReport, Report
from mixprec.pipeline.stages import STAGES, Pipeline
from mixprec.tune.result import TuneResult
from mixprec.weights.config import WeightsConfig

__all__ = [
    "DEFAULT_LISTS",
    "RULES",
    "STAGES",
    "BatchResult",
    "ConversionResult",
    "ConvertConfig",
    "EmulateLowPrecisionPass",
    "EmulateLowPrecisionResult",
    "InternalError",
    "MixprecError",
    "NodeReport",
    "OpClass",
    "OpRule",
    "OptimizeResult",
    "Pipeline",
    "Policy",
    "QuantizeConfig",
    "Report",
    "TuneResult",
    "ValidationReport",
    "WeightsConfig",
    "batch",
    "convert",
    "default_policy",
    "inspect",
    "optimize",
    "quantize",
    "register_rule",
    "tune",
    "validate",
]
