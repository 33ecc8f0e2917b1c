"""The user's side of a check: what a metric function is given and how it is called.

* :class:`Candidate`: a candidate model as a callable metric sees it (its outputs on the
  data being evaluated, and a way to run it on any other input);
* :func:`call_user_metric`: ``FUNCTION(fp32_outputs, outputs[, labels])``, one dict of
  outputs per sample, higher is better; the labels are the samples' arrays that are not
  model inputs (:data:`Labels`);
* :func:`shape_miss`: why two runs' outputs cannot be compared (a measured miss).

The INT8 guard (``--metric MODULE:FUNCTION``), ``tune`` and the checks of
:mod:`mixprec.checks.outputs` all call a user's metric through this module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from mixprec.inputs.feeds import feeds_for

__all__ = ["Candidate", "Labels", "Outputs", "call_user_metric", "shape_miss"]

Outputs = Mapping[str, np.ndarray]
#: One dict per sample of its arrays that are not model inputs (labels, boxes).
Labels = Sequence[Mapping[str, np.ndarray]]


class Candidate:
    """A candidate model as a callable metric sees it.

    Attributes:
        model: the candidate as an ``onnx.ModelProto`` (bfloat16 candidates emulated in
            float32 where the runtime refuses bfloat16, as ONNX Runtime's CPU provider does).
        session: the runtime's session of ``model``
            (:class:`~mixprec.runtime.engine.Session`: ``session.run(feeds)`` gives the
            outputs by name).
    """

    def __init__(self, model: Any, session: Any, samples: Sequence[Mapping[str, np.ndarray]]):
        self.model = model
        self.session = session
        self._samples = samples
        self._outputs: list[dict[str, np.ndarray]] | None = None
        self._signature: ir.Model | None = None

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The candidate's outputs, by name, for one feed dict (float arrays are cast to
        the dtypes the model takes)."""
        if self._signature is None:  # read once: the inputs' names and dtypes
            model = self.model
            self._signature = model if isinstance(model, ir.Model) else ir.from_proto(model)
        return dict(self.session.run(feeds_for(self._signature, feeds)))

    @property
    def outputs(self) -> list[dict[str, np.ndarray]]:
        """Its outputs on each sample of the data being evaluated, in order."""
        if self._outputs is None:
            self._outputs = [self.run(s) for s in self._samples]
        return self._outputs


def shape_miss(ref: Sequence[Outputs], out: Sequence[Outputs]) -> str | None:
    """Why the candidate's outputs cannot be compared with FP32's, or None: an output whose
    shape depends on values (a predicted length) came out another shape. A measured miss,
    never an error."""
    for k, (r, o) in enumerate(zip(ref, out, strict=True)):
        for name, value in r.items():
            got = np.shape(o[name]) if name in o else None
            if got != np.shape(value):
                return f"output {name!r} of sample {k} has shape {got}, FP32 {np.shape(value)}"
    return None


def _takes_labels(function: Callable[..., float]) -> bool:
    """Whether ``function`` takes the labels: a third positional parameter without a
    default or named ``labels``, or ``*args``. A third one with a default (``def f1(fp32,
    int8, threshold=0.3)``) is the function's own option, not the labels."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: two arguments
        return False
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    third = [p for p in parameters if p.kind in positional][2:3]
    return bool(third) and (
        third[0].default is inspect.Parameter.empty or third[0].name == "labels"
    )


def call_user_metric(
    function: Callable[..., float],
    reference: Sequence[Outputs],
    outputs: Sequence[Outputs],
    labels: Labels | None = None,
) -> float:
    """The user's score: ``function(fp32_outputs, outputs)``, or ``function(fp32_outputs,
    outputs, labels)`` when it takes a third argument, each a list with one entry per
    sample; ``labels`` is None when no sample carries arrays other than model inputs.

    Example:
        >>> def accuracy(fp32, int8, labels):                                # doctest: +SKIP
        ...     hits = [o["logits"].argmax(-1) == l["label"] for o, l in zip(int8, labels)]
        ...     return float(np.mean(np.concatenate(hits)))
    """
    given = list(labels) if labels is not None and any(labels) else None
    if _takes_labels(function):
        return float(function(list(reference), list(outputs), given))
    return float(function(list(reference), list(outputs)))
