"""mixprec: FP32 ONNX models to FP16/BF16 mixed precision.

Example:
    >>> import mixprec
    >>> result = mixprec.convert("model.onnx", "fp16")          # doctest: +SKIP
    >>> result.save("model_fp16.onnx")                           # doctest: +SKIP
    >>> print(result.report.format_summary())                    # doctest: +SKIP
"""

from __future__ import annotations

from mixprec._config import ConvertConfig
from mixprec._convert import ConversionResult, convert, inspect
from mixprec._emulate import EmulateLowPrecisionPass, EmulateLowPrecisionResult
from mixprec._errors import InternalError, MixprecError
from mixprec._pipeline import STAGES, Pipeline
from mixprec._policy import (
    DEFAULT_LISTS,
    RULES,
    OpClass,
    OpRule,
    Policy,
    default_policy,
    register_rule,
)
from mixprec._quantize import QuantizeConfig, quantize
from mixprec._report import NodeReport, Report
from mixprec._tune import tune
from mixprec._tune_result import TuneResult
from mixprec._validate import validate
from mixprec._validation import ValidationReport

__all__ = [
    "DEFAULT_LISTS",
    "RULES",
    "STAGES",
    "ConversionResult",
    "ConvertConfig",
    "EmulateLowPrecisionPass",
    "EmulateLowPrecisionResult",
    "InternalError",
    "MixprecError",
    "NodeReport",
    "OpClass",
    "OpRule",
    "Pipeline",
    "Policy",
    "QuantizeConfig",
    "Report",
    "TuneResult",
    "ValidationReport",
    "convert",
    "default_policy",
    "inspect",
    "quantize",
    "register_rule",
    "tune",
    "validate",
]

__version__ = "0.1.0"
