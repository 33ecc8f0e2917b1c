"""What ``optimize`` holds every candidate to: the held-out samples and the input's
outputs on them in ONNX Runtime (:func:`held_out`; a candidate that fits nothing to the
data is checked on calibration samples too), the tolerance of a candidate where no data
was given (:func:`tolerance`), and the user's metric (:func:`user_metric`)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.checks.guard_samples import MAX_HELD_OUT, Samples, label_dicts, split_for_guard
from mixprec.checks.outputs import GuardBudget, OutputCheck, UserMetric, check_outputs, output_kinds
from mixprec.core.callables import load_callable
from mixprec.core.errors import MixprecError
from mixprec.core.metrics import DEFAULT_RTOL
from mixprec.core.ops import parse_dtype
from mixprec.core.output_kinds import OutputKind
from mixprec.core.readings import with_user_kinds
from mixprec.inputs.feeds import feeds_for
from mixprec.optimize.candidates import Candidate
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import engine_for

__all__ = ["FP32_RTOL", "GENERATED", "HeldOut", "held_out", "tolerance", "user_metric"]

Feeds = dict[str, np.ndarray]


def user_metric(metric: Any, budget: float | None) -> UserMetric | None:
    """``metric`` (a callable or ``"MODULE:FUNCTION"``) with its lowest accepted score.

    Raises:
        MixprecError: one of the two without the other, or a budget that is no number.
    """
    if metric is None and budget is None:
        return None
    if metric is None:
        raise MixprecError("metric_budget (--metric-budget) needs metric (--metric)")
    if budget is None:
        raise MixprecError("metric needs metric_budget (--metric-budget): its lowest score")
    if isinstance(budget, bool) or not isinstance(budget, int | float) or math.isnan(budget):
        raise MixprecError(f"metric_budget must be a number, not {budget!r}")
    score = load_callable(metric) if isinstance(metric, str) else metric
    if not callable(score):
        raise MixprecError(f"metric must be a callable or 'MODULE:FUNCTION', not {metric!r}")
    return UserMetric(score, float(budget), getattr(score, "__name__", "metric"))


#: How candidates are checked on generated inputs, and what the last line adds.
GENERATED = "each candidate held to convert's relative L2 for its precision"
#: Convert's relative L2 bound for an FP32 model run elsewhere (validate's, for a model
#: with no low-precision tensor).
FP32_RTOL = 1e-4


@dataclass(frozen=True)
class HeldOut:
    """The held-out samples' feeds, the input's outputs on them in ONNX Runtime, their
    labels, each output's kind, the budget and the user's metric."""

    feeds: list[Feeds]
    reference: list[dict[str, np.ndarray]]
    labels: list[Feeds] | None
    kinds: dict[str, OutputKind]
    budget: GuardBudget
    metric: UserMetric | None
    how: str = "held out of calibration"

    def check(
        self, proto: onnx.ModelProto, options: RuntimeOptions, rel_l2: float | None = None
    ) -> tuple[OutputCheck, ...]:
        """The candidate's checks, run in its own engine (``rel_l2``: its bound in place
        of the budget's).

        Raises:
            MixprecError: the engine cannot load or run it (the candidate failed).
        """
        session = engine_for(options).session(proto, options)
        outputs = [session.run(f) for f in self.feeds]
        budget = self.budget if rel_l2 is None else dataclasses.replace(self.budget, rel_l2=rel_l2)
        return tuple(
            check_outputs(self.reference, outputs, self.kinds, budget, self.metric, self.labels)
        )


def held_out(
    source: onnx.ModelProto,
    model: ir.Model,
    data: tuple[Samples, Samples | None],
    *,
    threads: int,
    metric: UserMetric | None,
    kinds: Mapping[str, OutputKind],
    generated: bool,
) -> tuple[HeldOut, HeldOut | None]:
    """The held-out samples every candidate is checked on, and, where the data has more,
    those with up to :data:`MAX_HELD_OUT` of the calibration samples beside them: the
    rows a candidate that fits nothing to the data (the input in each runtime, under any
    precision hint) is checked on, since no sample is in-sample for it."""
    split = split_for_guard(data[0], data[1], model)
    samples = list(split.held)
    more = []
    if split.calibration is not None and not split.in_sample:
        more = list(itertools.islice(split.calibration, MAX_HELD_OUT))
    inputs = {v.name or "" for v in model.graph.inputs}
    feeds = [feeds_for(model, s) for s in [*samples, *more]]
    labels = label_dicts([*samples, *more], inputs)
    options = RuntimeOptions(threads=threads)
    session = engine_for(options).session(source, options)
    reference = [session.run(f) for f in feeds]
    budget = GuardBudget.of(None, None)
    read = with_user_kinds(output_kinds(model), dict(kinds))
    if generated:  # generated inputs hold no answers to read: convert's rel L2
        read = {name: OutputKind("rel-l2", reason=GENERATED) for name in read}
    how = "eval data" if split.given else "held out of calibration"
    if split.in_sample:
        how = "too few to hold any out: the calibration samples themselves"
    n = len(samples)
    held = HeldOut(feeds[:n], reference[:n], _labels(labels[:n]), read, budget, metric, how)
    if not more:
        return held, None
    every = f"{how}, and {len(more)} calibration sample(s): it fits nothing to them"
    wide = HeldOut(feeds, reference, _labels(labels), read, budget, metric, every)
    return held, wide


def _labels(labels: list[Feeds]) -> list[Feeds] | None:
    return labels if any(labels) else None


def tolerance(candidate: Candidate, generated: bool) -> float | None:
    """Without data: convert's relative L2 for the candidate's precision (FP32's for
    the input in any runtime); with data: None, the guard's own budget."""
    if not generated:
        return None
    precision = candidate.precision if candidate.fits_nothing else candidate.build
    if candidate.fp32 or not isinstance(precision, str):
        return FP32_RTOL
    lowered = parse_dtype(precision.removesuffix("-marks"), ("float16", "bfloat16"))
    return DEFAULT_RTOL[lowered]
