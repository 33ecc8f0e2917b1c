"""The staged converter: prepare -> calibrate -> annotate -> apply -> cleanup -> check.

Each stage is an ``onnx_ir.passes.Sequential`` of passes built from a frozen
:class:`~mixprec.core.config.ConvertConfig`. Analyses attach what they find to the model
(``model.meta`` for the calibration, ``node.meta`` for decisions and MACs), so a later
stage, the report or a tuner reads it there. A stage can be run alone: ``inspect`` stops
after ``annotate``; a tuner re-runs ``annotate`` and ``apply`` on copies of a
calibrated model without calibrating again; INT8 swaps the ``apply`` stage.

A failure names its stage and pass: user errors keep their class
(:class:`MixprecError`), anything else becomes an :class:`InternalError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar

import onnx_ir as ir
import onnx_ir.passes.common as common

from mixprec.calibrate.measure import CalibratePass, CountMacsPass
from mixprec.core.config import ConvertConfig
from mixprec.core.errors import InternalError, MixprecError
from mixprec.inputs.feeds import CheckGeneratedSizePass
from mixprec.io.external import ResolveExternalDataPass
from mixprec.passes.cleanup import CheckModelPass, DropAddedAnnotationsPass, KeepInputSketchPass
from mixprec.passes.fold import FoldBatchNormPass, FoldCastsPass
from mixprec.passes.input_checks import CheckAxesPass, CheckInputPass
from mixprec.passes.opset import UpgradeOpsetPass, ops_needing_upgrade
from mixprec.passes.sanitize import (
    CheckOptionsPass,
    InlineFunctionsPass,
    RepairNamesPass,
    SetIrVersionPass,
    SortNodesPass,
)
from mixprec.passes.shapes import InferShapesPass
from mixprec.precision.paint import PaintPass
from mixprec.precision.rewrite import ApplyPrecisionPass, RemoveRedundantCastsPass
from mixprec.runtime.kernels import missing_kernels

__all__ = ["STAGES", "Pipeline", "Stage"]

STAGES = ("prepare", "calibrate", "annotate", "apply", "cleanup", "check")

R = TypeVar("R", bound=ir.passes.PassResult)


class Stage(ir.passes.Sequential):
    """A named sequence of passes that keeps every pass's result.

    Errors are re-raised naming ``stage/PassName``: a :class:`MixprecError` (the user's
    input) keeps its class, any other exception becomes an :class:`InternalError`.
    """

    def __init__(self, name: str, *passes: ir.passes.PassBase) -> None:
        super().__init__(*passes)
        self.name = name
        self.results: list[ir.passes.PassResult] = []
        self.seconds: dict[str, float] = {}  # by pass class name, summed

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.results = []
        self.seconds = {}
        modified = False
        for pass_ in self.passes:
            kind = type(pass_).__name__
            where = f"{self.name}/{kind}"
            start = time.perf_counter()
            try:
                result = pass_(model)
            except (MixprecError, InternalError) as exc:
                if exc.stage is None:
                    exc.stage = where
                raise
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                raise InternalError(f"{type(exc).__name__}: {first}", stage=where) from exc
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start
            self.results.append(result)
            model = result.model
            modified = modified or result.modified
        return ir.passes.PassResult(model, modified)

    def result(self, kind: type[R]) -> R | None:
        """The result of the first pass that returned a ``kind``, if any ran."""
        for result in self.results:
            if isinstance(result, kind):
                return result
        return None


class Pipeline:
    """Builds and runs the stages for one config (a subclass swapping in its own passes
    names them in ``messages``, the progress line per stage).

    Args:
        config: the resolved configuration.
        calibration_data: one feed dict, or an iterable of them, for the ``calibrate``
            stage; None generates one sample from the model's signature.
        progress: called with a short message as each stage starts.
    """

    def __init__(
        self,
        config: ConvertConfig,
        *,
        calibration_data: Mapping[str, Any] | Iterable[Mapping[str, Any]] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.calibration_data = calibration_data
        self.say = progress or (lambda _msg: None)
        self.stages: dict[str, Stage] = {}
        self.timings: dict[str, float] = {}
        self.keep_annotations: set[str] = set()

    #: Progress lines that replace the defaults (``_MESSAGES``) for some stages.
    messages: ClassVar[Mapping[str, str]] = {}

    def build(self, name: str, model: ir.Model) -> Stage:
        """The stage ``name`` for ``model`` as it stands now (stages read earlier results)."""
        builders = {
            "prepare": self._prepare,
            "calibrate": self._calibrate,
            "annotate": self._annotate,
            "apply": self._apply,
        }
        if name in builders:
            return Stage(name, *builders[name](model))
        if name == "cleanup":
            return Stage(name, DropAddedAnnotationsPass(self.keep_annotations))
        if name == "check":
            return Stage(name, CheckModelPass())
        raise MixprecError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")

    def _prepare(self, model: ir.Model) -> list[ir.passes.PassBase]:
        """Checks and repairs of the input first: later passes assume a sound model."""
        config = self.config
        passes: list[ir.passes.PassBase] = [
            # A model handed to the stages directly may still refer to files: read
            # them from its own folder only (convert's loading has done it already).
            ResolveExternalDataPass(),
            CheckOptionsPass(
                config.keep_io_types,
                calibrate=config.calibrate,
                has_calibration_data=self.calibration_data is not None,
            ),
            RepairNamesPass(),
            CheckInputPass(),
        ]
        if config.calibrate and self.calibration_data is None:  # a sample will be generated
            passes.append(CheckGeneratedSizePass(config.shapes))
        passes += [
            KeepInputSketchPass(),
            SetIrVersionPass(),
        ]
        if model.functions:
            passes.append(InlineFunctionsPass())
        passes += [SortNodesPass(), common.NameFixPass()]
        # bf16 keeps BatchNormalization whole: folded into a bf16 Conv, its shift becomes a
        # rounded bias beside a rounded scale (PP-OCR's orientation classifier: rel L2 0.19
        # folded against 0.03 kept, on OpenVINO's bf16 kernels); kept, its rule decides.
        if config.fold_batchnorm and config.policy.target != "bfloat16":
            passes += [FoldBatchNormPass(), common.RemoveUnusedNodesPass()]
        # Casts of constants are folded before inference: a Reshape whose shape input
        # becomes a constant may reveal a declared shape the graph contradicts.
        return [
            *passes,
            FoldCastsPass(),
            InferShapesPass(),
            CheckAxesPass(),
            FoldCastsPass(),  # identity casts, now that every dtype is known
            common.RemoveUnusedNodesPass(),
        ]

    def _calibrate(self, model: ir.Model) -> list[ir.passes.PassBase]:
        config = self.config
        data = self.calibration_data if config.calibrate else None
        return [CalibratePass(config.shapes, data, observer=config.observer, run=config.calibrate)]

    def _annotate(self, model: ir.Model) -> list[ir.passes.PassBase]:
        config = self.config
        passes: list[ir.passes.PassBase] = []
        if config.upgrade_opset and ops_needing_upgrade(model, config.policy):
            # Types survive the upgrade by name; only nodes it adds need inference.
            # never to an opset whose version of an op ORT does not implement
            upgrade = UpgradeOpsetPass(config.policy, missing=missing_kernels)
            passes += [upgrade, InferShapesPass(only_untyped=True)]
        # The painter reads the calibration and the shapes from the model's meta.
        paint = PaintPass(
            config.policy,
            range_threshold=config.range_threshold,
            keep_io_types=config.keep_io_types,
        )
        return [*passes, CountMacsPass(), paint]

    def _apply(self, model: ir.Model) -> list[ir.passes.PassBase]:
        config = self.config
        return [
            ApplyPrecisionPass(
                config.policy, keep_io_types=config.keep_io_types, clip_weights=config.clip_weights
            ),
            RemoveRedundantCastsPass(),
            common.RemoveUnusedNodesPass(),
        ]

    def run(self, model: ir.Model, *, start: str = "prepare", until: str = "check") -> ir.Model:
        """Run the stages from ``start`` through ``until`` (inclusive) on ``model``.

        ``model`` is changed in place except where a stage returns a new model (the
        bfloat16 opset upgrade): always use the returned model.
        """
        for name in (start, until):
            if name not in STAGES:
                raise MixprecError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
        first, last = STAGES.index(start), STAGES.index(until)
        for name in STAGES[first : last + 1]:
            if name == "check" and not self.config.check:
                continue
            self.say(self.messages.get(name) or _MESSAGES[name])
            t = time.perf_counter()
            stage = self.build(name, model)
            model = stage(model).model
            self.stages[name] = stage
            self.timings[name] = time.perf_counter() - t
        return model


_MESSAGES = {
    "prepare": "preparing (inline, fold BatchNormalization, shape inference)",
    "calibrate": "calibrating ranges with onnxruntime",
    "annotate": "painting",
    "apply": "inserting casts",
    "cleanup": "cleaning up",
    "check": "checking the result",
}
