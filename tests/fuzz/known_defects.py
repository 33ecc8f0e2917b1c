"""Fuzz cases that reveal a defect not fixed yet, and the causes they show.

A :class:`Cause` is one defect of mixprec: the outcome kind it produces (see
``classify.KINDS``), a regex that its detail line matches, and a short explanation. Each
:class:`KnownDefect` is one reproducible case of the pytest budget (mutation, seed) and
its cause. The pytest run marks these cases ``xfail(strict=True)``: when a fix lands the
case passes, the test fails (XPASS), and the entry must be removed; the hypothesis
sequences accept a defect only when it matches a known cause. Reproduce a case with
``.venv/bin/python -m tests.fuzz --mutation NAME --seed N`` (``--keep DIR`` keeps files).
"""

from __future__ import annotations

import dataclasses
import re

__all__ = [
    "CAUSES",
    "KNOWN",
    "REGRESSIONS",
    "Cause",
    "KnownDefect",
    "known_for",
    "matches_known",
]


@dataclasses.dataclass(frozen=True)
class Cause:
    kind: str  # the defect kind observed (classify.KINDS)
    match: str  # regex searched in the outcome's detail line
    text: str  # the cause, in a sentence

    def matches(self, kind: str | None, detail: str) -> bool:
        return kind == self.kind and re.search(self.match, detail) is not None


_CHECK = "internal error in stage 'check/CheckModelPass': the converted model fails onnx.checker"

CAUSES: dict[str, Cause] = {
    "input-not-checked": Cause(
        "internal-error",
        re.escape(_CHECK),
        "an input that onnx.checker rejects (nodes out of topological order, a graph output "
        "no node produces, ir_version 0/1/3/99) is converted and only the final "
        "CheckModelPass notices: exit 3 blames mixprec; load_model should check the input "
        "and exit 2 naming the problem",
    ),
    "serialize-fails-in-prepare": Cause(
        "internal-error",
        r"InferShapesPass': SerdeError: Error calling serialize_model_into",
        "onnx_ir loads what it cannot serialize again (an attribute of type UNDEFINED (0), a "
        "node or tensor name that is not UTF-8); InferShapesPass serializes and fails: exit "
        "3 instead of a one-line error at load",
    ),
    "recursive-functions": Cause(
        "internal-error",
        r"InlinePass': PreconditionError: Cyclic dependency detected between functions",
        "model-local functions that call themselves or each other: onnx_ir's InlinePass "
        "raises PreconditionError, exit 3 instead of exit 2",
    ),
    "function-opset-mismatch": Cause(
        "internal-error",
        r"InlinePass': ValueError: Opset mismatch when inlining function",
        "a model-local function importing another default-domain opset than the model: "
        "InlinePass raises ValueError, exit 3 (convert the function's opset or exit 2)",
    ),
    "tensor-bytes-short": Cause(
        "internal-error",
        r"ValueError: (buffer (is smaller than requested size|size must be a multiple of "
        r"element size)|offset must be non-negative and no greater than buffer length|"
        r"cannot reshape array of size \d+ into shape)",
        "tensor bytes that do not match the dims (raw_data short or not a whole number of "
        "elements; external data offset/length past the end of the file) are read lazily "
        "by FoldBatchNormPass/CalibratePass: ValueError, exit 3; load_model checks the "
        "external file exists but not its size",
    ),
    "external-location-is-folder": Cause(
        "internal-error",
        r"ValueError: External data path .* has multiple hard links",
        "external data location '.' or '' names the model's folder itself, which "
        "load_model accepts (target == base); onnx_ir then refuses it (hard link check): "
        "exit 3 instead of exit 2",
    ),
    "undefined-attribute-type": Cause(
        "internal-error",
        r"TypeError: Attribute .* is not of type \w+\. Actual type: \w+",
        "an attribute of the wrong type (UNDEFINED (0), STRING, FLOATS) that a pass reads "
        "(BatchNormalization epsilon in FoldBatchNormPass, Softmax axis in CalibratePass): "
        "TypeError, exit 3; load should check attribute types against the schema",
    ),
    "cast-to-unknown-type": Cause(
        "internal-error",
        r"ValueError: -?\d+ is not a valid DataType",
        "Cast(to=999) or Cast(to=-1): onnx_ir's DataType(to) raises ValueError, exit 3 "
        "instead of exit 2 naming the Cast",
    ),
    "dangling-input-in-function": Cause(
        "internal-error",
        r"InlinePass': RuntimeError: In clone_node",
        "a model-local function whose body reads a tensor nobody produces: InlinePass fails "
        "in clone_node (RuntimeError), exit 3 instead of exit 2",
    ),
    "duplicate-opset-import": Cause(
        "output-fails-in-ort",
        r"Type 'tensor\(bfloat16\)' of input parameter .* is invalid",
        "the default domain imported twice (two versions): mixprec and the checker read one "
        "version, ONNX Runtime the other, which does not admit bfloat16 Conv; a duplicate "
        "opset import should be a load error",
    ),
    "undefined-tensor-type": Cause(
        "internal-error",
        r"TypeError: Bitwidth not available for ONNX data type: UNDEFINED",
        "an initializer with data_type 0 (UNDEFINED): TypeError while counting bytes, exit 3",
    ),
    "onnx-ir-warnings-then-error": Cause(
        "warning-before-error",
        r"onnx_ir: (Input .* cannot be found in any scope|Output .* is not produced by any "
        r"node)",
        "a dangling reference (node input nobody produces, deleted initializer or renamed "
        "graph input, graph output no node produces): onnx_ir warns once per reference, "
        "then ONNX Runtime refuses the model in calibrate: several stderr lines; validate "
        "references at load and fail in one line",
    ),
    "shape-inference-warning-then-error": Cause(
        "warning-before-error",
        r"shape inference failed, using declared types only",
        "strict shape inference fails (unknown domain without an opset import, initializer "
        "type or rank disagreeing with its declaration), mixprec warns and goes on, and "
        "ONNX Runtime then refuses the model in calibrate: two stderr lines; the inference "
        "error should be the one error line",
    ),
}


@dataclasses.dataclass(frozen=True)
class KnownDefect:
    mutation: str  # a mutation's name, or names joined by "+" for a sequence
    seed: int
    cause: str  # a key of CAUSES

    @property
    def kind(self) -> str:
        return CAUSES[self.cause].kind

    def matches(self, kind: str | None, detail: str) -> bool:
        return CAUSES[self.cause].matches(kind, detail)


KNOWN: tuple[KnownDefect, ...] = ()

#: Cases a campaign found and a fix closed, kept in the suite as (mutation, seed): each
#: must stay a valid conversion or a clean one-line error.
REGRESSIONS: tuple[tuple[str, int], ...] = (
    # the input's own value_info declares a Loop output of another rank (onnx.checker
    # rejects the input): exit 3 blamed mixprec; now one line naming the input's fault
    ("wrong_dims", 7779),
)


def known_for(mutation: str, seed: int) -> KnownDefect | None:
    for entry in KNOWN:
        if entry.mutation == mutation and entry.seed == seed:
            return entry
    return None


def matches_known(kind: str | None, detail: str) -> str | None:
    """The key of the known cause an outcome shows (same kind, detail matches), if any."""
    for key, cause in CAUSES.items():
        if cause.matches(kind, detail):
            return key
    return None
