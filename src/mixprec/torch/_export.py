"""Export a torch module to ONNX: the dynamo exporter first, the TorchScript one second.

``torch.onnx.export(..., dynamo=True)`` returns an ``ONNXProgram`` whose ``.model`` is
an ``onnx_ir.Model``, which mixprec converts directly. When it fails (data-dependent
control flow, an op torch.export cannot trace), the TorchScript exporter runs with the
same inputs and the dynamic axes read from the same spec. Both failing raises one
:class:`~mixprec.MixprecError` naming each exporter's failing op where it can be found.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
import onnx_ir as ir
import torch

from mixprec.core.errors import MixprecError

__all__ = ["DYNAMO", "TORCHSCRIPT", "Exported", "export_module"]

logger = logging.getLogger(__name__)

DYNAMO = "torch.onnx.export(dynamo=True)"
TORCHSCRIPT = "torch.onnx.export(dynamo=False) (TorchScript)"
# The TorchScript exporter's newest opset in torch 2.13; mixprec raises it when needed.
_TORCHSCRIPT_OPSET = 18
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_OP_PATTERNS = (
    re.compile(r"OpOverload\(op='([\w.:]+)'"),
    re.compile(r"target=torch\.ops\.([\w.]+)"),
    re.compile(r"unrecognized namespace ([\w.:]+)"),
    re.compile(r"operator '?([a-z_]\w*::\w+)"),
    re.compile(r"\b(aten::\w+)"),
)


@dataclass
class Exported:
    """An exported module.

    Attributes:
        model: the FP32 ONNX model.
        exporter: :data:`DYNAMO` or :data:`TORCHSCRIPT`.
        input_names: graph input name per flattened module input, in call order.
        notes: what happened on the way (the dynamo error when it fell back).
    """

    model: ir.Model
    exporter: str
    input_names: list[str]
    notes: list[str] = field(default_factory=list)


def failing_op(message: str) -> str | None:
    """The op an exporter's error message blames, e.g. ``"mixprec_test.weird"``."""
    for pattern in _OP_PATTERNS:
        match = pattern.search(message)
        if match:
            return match.group(1).rstrip(".").removesuffix(".default")
    return None


def summarize_error(exc: BaseException) -> str:
    """One line for an exporter's exception: the op it blames, then its summary line."""
    text = _ANSI.sub("", str(exc))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    summary = lines[0] if lines else type(exc).__name__
    if "## Exception summary" in lines:
        rest = lines[lines.index("## Exception summary") + 1 :]
        summary = rest[0] if rest else summary
    summary = f"{type(exc).__name__}: {summary}"[:400]
    op = failing_op(text)
    return f"op {op}: {summary}" if op else summary


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the exporters' deprecation notes and registry chatter (not their errors)."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def default_dynamic_shapes(inputs: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Every dim of every input left to torch.export to make dynamic (``Dim.AUTO``): the
    converted module takes what the original took (another batch, sequence length or
    image size); dims the model itself fixes stay static, and the notes say which."""
    auto = torch.export.Dim.AUTO
    return {name: dict.fromkeys(range(tensor.dim()), auto) for name, tensor in inputs}


def _axis_name(dim: object, input_name: str, axis: int) -> str:
    name = getattr(dim, "__name__", None)
    return name if isinstance(name, str) else f"{input_name}_dim{axis}"


def dynamic_axes_of(
    spec: Mapping[str, Any] | Sequence[Any], names: Sequence[str]
) -> dict[str, dict[int, str]]:
    """The TorchScript exporter's ``dynamic_axes`` for a torch.export ``dynamic_shapes``.

    ``spec`` is a dict keyed by input name or a sequence in input order, each entry a
    ``{axis: Dim}`` dict or a sequence with ``None`` for static axes.
    """
    entries = spec.items() if isinstance(spec, Mapping) else zip(names, spec, strict=False)
    axes: dict[str, dict[int, str]] = {}
    for name, entry in entries:
        if entry is None:
            continue
        pairs = entry.items() if isinstance(entry, Mapping) else enumerate(entry)
        dims = {int(a): _axis_name(d, name, int(a)) for a, d in pairs if d is not None}
        if dims:
            axes[name] = dims
    return axes


def _dynamo(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic_shapes: Any,
) -> ir.Model:
    with _quiet():
        program = torch.onnx.export(
            module, args, kwargs=kwargs, dynamo=True, dynamic_shapes=dynamic_shapes, verbose=False
        )
    if program is None or not isinstance(program.model, ir.Model):
        raise MixprecError("torch.onnx.export(dynamo=True) returned no onnx_ir model")
    return program.model


def _torchscript(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    names: list[str],
    dynamic_axes: dict[str, dict[int, str]],
) -> ir.Model:
    call_args: tuple[Any, ...] = (*args, kwargs) if kwargs else args
    # A private folder: the exporter writes external data files beside large models.
    with tempfile.TemporaryDirectory(prefix="mixprec-torch-") as tmp, _quiet():
        path = os.path.join(tmp, "model.onnx")
        torch.onnx.export(
            module,
            call_args,
            path,
            dynamo=False,
            input_names=names,
            dynamic_axes=dynamic_axes,
            opset_version=_TORCHSCRIPT_OPSET,
            do_constant_folding=True,
        )
        return ir.from_proto(onnx.load(path))


def _specialized(model: ir.Model, asked: Mapping[str, Mapping[int, str]]) -> list[str]:
    """A note per input dim asked to be dynamic that the exported graph fixed."""
    notes = []
    for value in model.graph.inputs:
        shape = value.shape
        for axis in asked.get(value.name or "", {}):
            if shape is not None and axis < len(shape) and isinstance(shape[axis], int):
                note = (
                    f"input {value.name!r} dim {axis} was asked to be dynamic, but the export "
                    f"fixed it to {shape[axis]}: other sizes there will be refused"
                )
                logger.warning("%s", note)
                notes.append(note)
    return notes


def kept_static(model: ir.Model) -> list[str]:
    """One note (and warning) naming the input dims the export fixed although every dim
    was offered as dynamic: the model's own computation pins them (a channel count that
    must match a weight, a length a reshape needs)."""
    fixed = [
        f"{value.name} dim {axis} = {dim}"
        for value in model.graph.inputs
        if value.shape is not None
        for axis, dim in enumerate(value.shape)
        if isinstance(dim, int)
    ]
    if not fixed:
        return []
    note = (
        "every input dim was exported as dynamic except those the model fixes: "
        f"{', '.join(fixed)} (calls with other sizes there are refused, naming the dim)"
    )
    logger.warning("%s", note)
    return [note]


def export_module(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    inputs: Sequence[tuple[str, torch.Tensor]],
    dynamic_shapes: Any = None,
) -> Exported:
    """Export ``module`` (already in eval mode) called with ``args``/``kwargs``.

    Args:
        module: the module.
        args: positional example inputs.
        kwargs: keyword example inputs.
        inputs: ``(name, tensor)`` per input from :func:`~mixprec.torch._tree.bind_inputs`.
        dynamic_shapes: torch.export's spec; None makes every dim of every input dynamic
            where torch.export finds it can be (``Dim.AUTO``).

    Raises:
        MixprecError: both exporters failed (stage "export"); the message names the op.
    """
    names = [name for name, _ in inputs]
    spec = default_dynamic_shapes(inputs) if dynamic_shapes is None else dynamic_shapes
    notes: list[str] = []
    try:
        with torch.no_grad():
            model = _dynamo(module, args, kwargs, spec)
        exporter = DYNAMO
    except Exception as dynamo_error:
        why = summarize_error(dynamo_error)
        logger.warning("the dynamo exporter failed (%s); trying the TorchScript exporter", why)
        notes.append(f"{DYNAMO} failed ({why}); exported with the TorchScript exporter")
        try:
            with torch.no_grad():
                model = _torchscript(module, args, kwargs, names, dynamic_axes_of(spec, names))
        except Exception as ts_error:
            raise MixprecError(
                f"cannot export the module to ONNX: {DYNAMO} failed on {why}; the TorchScript "
                f"exporter failed on {summarize_error(ts_error)}",
                stage="export",
            ) from ts_error
        exporter = TORCHSCRIPT
    graph_names = [v.name or "" for v in model.graph.inputs]
    if not set(graph_names) <= set(names):
        if len(graph_names) != len(names):
            raise MixprecError(
                f"the exported graph's inputs {graph_names} do not match the module's "
                f"inputs {names}",
                stage="export",
            )
        for value, name in zip(model.graph.inputs, names, strict=True):
            value.name = name
    if dynamic_shapes is not None:
        notes.extend(_specialized(model, dynamic_axes_of(dynamic_shapes, names)))
    else:
        notes.extend(kept_static(model))
    unused = [n for n in names if n not in graph_names]
    if unused:
        notes.append(f"inputs not used by the exported graph (ignored when given): {unused}")
    return Exported(model, exporter, names, notes)
