"""The converted module against the eager module: per output errors, pass or refuse.

Each example input runs through both, then a perturbed copy of it (float inputs plus
Gaussian noise of 5% of their standard deviation, seeded; integer and bool inputs kept),
so that the check is not only on the inputs calibration saw. Each output is compared by
:func:`mixprec.core.metrics.compare_outputs`: max abs error, relative L2 error, top-1
agreement for class scores. An output passes when its relative L2 error is at most the
threshold (the dtype's :data:`~mixprec.core.metrics.DEFAULT_RTOL`) or its max abs error is
at most :data:`CHECK_ATOL` (references near zero). With the caller's budget, the budget
is the threshold and the only test: no absolute escape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mixprec.checks.outputs import OutputCheck, closeness_checks, row_budget, row_readings
from mixprec.core.errors import MixprecError
from mixprec.core.metrics import DEFAULT_RTOL, OutputComparison, compare_outputs
from mixprec.core.ops import DEFAULT_ATOL
from mixprec.core.output_kinds import OutputKind

__all__ = ["CHECK_ATOL", "CheckReport", "TorchCheckError", "check_module", "perturbed"]

#: Max abs error accepted in place of the relative bound, for outputs near zero.
CHECK_ATOL = DEFAULT_ATOL
_NOISE = 0.05

Sample = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class SampleCheck:
    """One input's comparison: ``label`` ("example 0", "example 0 perturbed")."""

    label: str
    outputs: tuple[OutputComparison, ...]

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)


@dataclass(frozen=True)
class CheckReport:
    """The converted module against eager PyTorch.

    Attributes:
        dtype: "float16", "bfloat16" or "int8".
        threshold: max relative L2 error per output (the budget when one was given).
        atol: max abs error accepted instead, for outputs near zero.
        runtime: "onnxruntime" or "emulated" (a bfloat16 model ORT cannot run).
        samples: one comparison per input.
        checks: the verdict, in the one schema of "is it still the same model?"
            (:class:`~mixprec.checks.outputs.OutputCheck`): each output's ``rel-l2``
            check over every input (from ``samples``), then each output read as rows of
            answers (the guard's :func:`~mixprec.checks.outputs.check_outputs`: argmax
            rows, embedding rows, the worst channel), held to the dtype's bounds.
    """

    dtype: str
    threshold: float
    atol: float
    runtime: str
    samples: tuple[SampleCheck, ...]
    checks: tuple[OutputCheck, ...] = ()

    @property
    def passed(self) -> bool:
        """Every check passed: each output's rel L2 and every reading of its rows."""
        return bool(self.checks) and all(c.passed for c in self.checks)

    def worst(self) -> dict[str, dict[str, float | None]]:
        """Per output, the largest max abs and rel L2 error and the lowest top-1 agreement."""
        out: dict[str, dict[str, float | None]] = {}
        for sample in self.samples:
            for o in sample.outputs:
                w = out.setdefault(o.name, {"max_abs": 0.0, "rel_l2": 0.0, "top1": None})
                w["max_abs"] = max(w["max_abs"] or 0.0, o.max_abs_error)
                w["rel_l2"] = max(w["rel_l2"] or 0.0, o.rel_l2_error)
                if o.top1_agreement is not None:
                    top1 = w["top1"]
                    w["top1"] = o.top1_agreement if top1 is None else min(top1, o.top1_agreement)
        return out

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": "torch-eager",
            "dtype": self.dtype,
            "threshold": self.threshold,
            "atol": self.atol,
            "runtime": self.runtime,
            "passed": self.passed,
            "worst": self.worst(),
            "samples": [
                {"label": s.label, "outputs": [o.to_dict() for o in s.outputs]}
                for s in self.samples
            ],
            "checks": [c.to_dict() for c in self.checks],
        }

    def format_table(self) -> str:
        """One line per output: worst errors over all samples and whether it passed."""
        failed = {o.name for s in self.samples for o in s.outputs if not o.passed}
        lines = [
            f"vs eager PyTorch on {len(self.samples)} input(s), {self.runtime}, "
            f"threshold rel L2 {self.threshold:.3g} (or max abs {self.atol:.3g})"
        ]
        for name, w in self.worst().items():
            top1 = f", top-1 {w['top1']:.1%}" if w["top1"] is not None else ""
            verdict = "FAIL" if name in failed else "ok"
            lines.append(
                f"  {name}: max abs {w['max_abs']:.3g}, rel L2 {w['rel_l2']:.3g}{top1} {verdict}"
            )
        for c in self.checks:  # the rows' readings (each rel L2: the lines above)
            if c.kind != "rel-l2":
                lines.append(f"  {c.output}: {c.measured()} {'ok' if c.passed else 'FAIL'}")
        return "\n".join(lines)


class TorchCheckError(MixprecError):
    """The converted module is further from eager PyTorch than the tolerance or budget.

    Attributes:
        check: the :class:`CheckReport`.
        report: the conversion's :class:`mixprec.Report`.
    """

    def __init__(self, message: str, *, check: CheckReport, report: Any) -> None:
        super().__init__(message, stage="check")
        self.check = check
        self.report = report


def threshold_for(dtype: str, budget: float | None) -> float:
    """The max relative L2 error: ``budget`` when given, else the dtype's default."""
    if budget is None:
        return DEFAULT_RTOL[dtype]
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise MixprecError(f"budget must be a number (max relative L2 error), not {budget!r}")
    if not math.isfinite(budget) or budget <= 0:
        raise MixprecError(f"budget must be a finite number > 0, got {budget!r}")
    return float(budget)


def _perturb(value: Any, generator: torch.Generator) -> Any:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() < 2:
        return value
    scale = _NOISE * float(value.float().std())
    noise = torch.randn(value.shape, generator=generator, dtype=torch.float32)
    return value + (noise * scale).to(device=value.device, dtype=value.dtype)


def perturbed(samples: Sequence[Sample], seed: int = 0) -> list[Sample]:
    """A copy of each sample with noise on its float tensors (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            tuple(_perturb(a, generator) for a in args),
            {k: _perturb(v, generator) for k, v in kwargs.items()},
        )
        for args, kwargs in samples
    ]


def _arrays(leaves: Sequence[torch.Tensor]) -> list[np.ndarray]:
    return [
        t.detach().cpu().float().numpy() if t.is_floating_point() else t.detach().cpu().numpy()
        for t in leaves
    ]


def check_module(
    eager: Callable[[Sample], list[torch.Tensor]],
    converted: Callable[[Sample], list[torch.Tensor]],
    samples: Sequence[Sample],
    output_names: Sequence[str],
    *,
    dtype: str,
    threshold: float,
    atol: float = CHECK_ATOL,
    runtime: str,
    kinds: Sequence[OutputKind] | None = None,
) -> CheckReport:
    """Compare ``converted`` with ``eager`` on each sample and a perturbed copy of it.

    Args:
        eager: runs the original module on a sample; its flat output tensors.
        converted: runs the converted module the same way.
        samples: ``(args, kwargs)`` inputs.
        output_names: a name per flat output (its path in the output structure).
        dtype: "float16", "bfloat16" or "int8".
        threshold: max relative L2 error per output.
        atol: max abs error accepted instead (0 with a budget: the budget alone decides).
        runtime: how the converted module runs ("onnxruntime" or "emulated").
        kinds: each flat output's kind (the exported graph's, in order): the outputs are
            then also read as rows over every input (None: by their values).
    """
    labelled = [(f"example {i}", s) for i, s in enumerate(samples)]
    labelled += [(f"example {i} perturbed", s) for i, s in enumerate(perturbed(samples))]
    results, refs, outs = [], [], []
    for label, sample in labelled:
        with torch.no_grad():
            ref = dict(zip(output_names, _arrays(eager(sample)), strict=True))
        out = dict(zip(output_names, _arrays(converted(sample)), strict=True))
        comparisons = compare_outputs(ref, out, rtol=threshold, atol=atol)
        results.append(SampleCheck(label, tuple(comparisons)))
        refs.append(ref)
        outs.append(out)
    named = dict(zip(output_names, kinds or [OutputKind("other")] * len(output_names), strict=True))
    closeness = closeness_checks([r.outputs for r in results], threshold, atol)
    checks = row_readings(refs, outs, named, row_budget(dtype, threshold, atol))
    return CheckReport(dtype, threshold, atol, runtime, tuple(results), (*closeness, *checks))
