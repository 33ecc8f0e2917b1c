""":func:`convert_module`: export, convert or quantize, wrap, and check against eager."""

from __future__ import annotations

import ast
import re
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import onnx_ir as ir
import torch

from mixprec.api.convert import convert
from mixprec.api.quantize import quantize
from mixprec.api.tune import tune
from mixprec.core.errors import MixprecError
from mixprec.core.graphs import iter_nodes
from mixprec.core.output_kinds import classify_outputs
from mixprec.core.policy import normalize_dtype
from mixprec.torch._check import (
    CHECK_ATOL,
    Sample,
    TorchCheckError,
    check_module,
    perturbed,
    threshold_for,
)
from mixprec.torch._export import export_module
from mixprec.torch._module import ConvertedModule, ModuleSpec
from mixprec.torch._tree import bind_inputs, flatten_outputs, register_dataclasses

#: The dynamo exporter's record of the module scopes a node was made in.
NAME_SCOPES = "pkg.torch.onnx.name_scopes"

__all__ = ["convert_module"]


def _target(dtype: str) -> str:
    if isinstance(dtype, str) and dtype.strip().lower() in ("int8", "i8"):
        return "int8"
    return normalize_dtype(dtype)


def as_sample(value: object, where: str) -> Sample:
    """``(args, kwargs)`` from a tensor, a tuple/list of positional inputs, or a dict."""
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, tuple | list):
        return tuple(value), {}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise MixprecError(f"{where}: dict keys must be input names (str)")
        return (), dict(value)
    raise MixprecError(
        f"{where} must be a tensor, a tuple of positional inputs or a dict of inputs by "
        f"name, not {type(value).__name__}"
    )


def _feeds(module: torch.nn.Module, sample: Sample, graph_inputs: set[str]) -> dict[str, Any]:
    named = bind_inputs(module.forward, *sample)
    return {n: t.detach().cpu().numpy() for n, t in named if n in graph_inputs}


def _eager(module: torch.nn.Module, sample: Sample) -> list[torch.Tensor]:
    with torch.no_grad():
        return flatten_outputs(module(*sample[0], **sample[1]))[0]


def convert_module(
    module: torch.nn.Module,
    example_inputs: Any,
    *,
    dtype: str = "fp16",
    dynamic_shapes: Any = None,
    calibration_data: Iterable[Any] | None = None,
    check: bool = True,
    budget: float | None = None,
    providers: Sequence[str] | None = None,
    exclude_modules: Sequence[str] = (),
    **policy_options: Any,
) -> ConvertedModule:
    """Convert a torch module to an FP16/BF16 mixed-precision or INT8 ONNX Runtime module.

    Exports ``module`` with the dynamo exporter (the TorchScript exporter when that
    fails), converts the ONNX model with :func:`mixprec.convert` (or quantizes it with
    :func:`mixprec.quantize` for ``"int8"``), and wraps it as an ``nn.Module`` that takes
    and returns torch tensors in the original's structure. ``module`` is put in eval
    mode for the export and the check (with a warning if it was training), then set back
    to the mode it was in; its parameters and buffers are not changed.

    Args:
        module: the module to convert.
        example_inputs: one call's inputs: a tensor, a tuple of positional tensors, or a
            dict of tensors by ``forward``'s parameter names.
        dtype: "fp16"/"float16", "bf16"/"bfloat16" or "int8".
        dynamic_shapes: ``torch.export``'s spec (a dict by input name or a tuple); by
            default dim 0 of every input is made dynamic where torch.export finds it can
            be (``Dim.AUTO``).
        calibration_data: more inputs like ``example_inputs`` (an iterable of tuples or
            dicts). They set the INT8 scales (default: the example and a perturbed copy
            of it, with a warning) and the FP16/BF16 calibration ranges, and are checked.
        check: compare with eager PyTorch on each input and a perturbed copy (see
            :mod:`mixprec.torch._check`) and refuse a result outside the tolerance.
        budget: the max relative L2 error per output that the check accepts, in place of
            the dtype's default (1e-2 fp16, 8e-2 bf16, 1e-1 int8). When the plain
            conversion misses it, :func:`mixprec.tune` moves sensitive nodes to float
            and the tuned module is checked again.
        providers: ONNX Runtime execution providers (default: CUDA when available, CPU).
        exclude_modules: regexes over ``module.named_modules()`` names (``re.search``):
            every ONNX node the exporter made inside a matching submodule stays FP32 (the
            dynamo exporter's ``pkg.torch.onnx.name_scopes``), as
            :func:`mixprec.torch.autocast`'s ``exclude`` does in training:
            ``convert_module(model, x, **amp.convert_options())`` hands its lists over.
        **policy_options: passed to :func:`mixprec.convert` (e.g. ``deny_add``,
            ``exclude_nodes``) or :func:`mixprec.quantize` (e.g. ``method``, ``speed``).

    Returns:
        A :class:`ConvertedModule` (``.report``, ``.onnx_model``, ``.check``, ``.save()``).

    Raises:
        MixprecError: a non-tensor input, both exporters failed (naming the op), a bad
            option; :class:`TorchCheckError` (a MixprecError carrying ``.check`` and
            ``.report``) when the check fails.

    Example:
        >>> fast = mixprec.torch.convert_module(model, (images,), dtype="fp16")  # doctest: +SKIP
        >>> logits = fast(images)                                               # doctest: +SKIP
    """
    if not isinstance(module, torch.nn.Module):
        raise MixprecError(f"module must be a torch.nn.Module, not {type(module).__name__}")
    target = _target(dtype)
    # (max rel L2, max abs accepted instead), or None: no check.
    limits: tuple[float, float] | None = None
    if check:
        limits = (threshold_for(target, budget), CHECK_ATOL if budget is None else 0.0)
    args, kwargs = as_sample(example_inputs, "example_inputs")
    inputs = bind_inputs(module.forward, args, kwargs)
    extra = [as_sample(s, f"calibration_data[{i}]") for i, s in enumerate(calibration_data or ())]
    was_training = module.training
    if was_training:
        warnings.warn(
            f"{type(module).__name__} is in training mode: converting it in eval mode "
            "(dropout off, BatchNorm running statistics); it is set back to training after",
            UserWarning,
            stacklevel=2,
        )
    if exclude_modules:
        policy_options["exclude_modules"] = tuple(exclude_modules)
    module.eval()
    try:
        return _convert(
            module,
            (args, kwargs),
            inputs,
            extra,
            target,
            dynamic_shapes,
            limits,
            providers,
            policy_options,
            budget,
        )
    finally:
        module.train(was_training)


def _with_module_exclusions(model: ir.Model, options: dict[str, Any]) -> dict[str, Any]:
    """``exclude_modules`` turned into the names of the nodes made inside those modules."""
    patterns = [re.compile(p) for p in options.get("exclude_modules", ())]
    options = {k: v for k, v in options.items() if k != "exclude_modules"}
    if not patterns:
        return options
    names = []
    for node in iter_nodes(model.graph):
        text = node.metadata_props.get(NAME_SCOPES, "")
        scopes = ast.literal_eval(text) if text.startswith("[") else []
        if node.name and any(p.search(s) for s in scopes if s for p in patterns):
            names.append(f"^{re.escape(node.name)}$")
    if not names:
        warnings.warn(
            f"exclude_modules {[p.pattern for p in patterns]}: no exported node is inside a "
            "matching module (only the dynamo exporter records module scopes)",
            UserWarning,
            stacklevel=4,
        )
    options["exclude_nodes"] = [*options.get("exclude_nodes", ()), *names]
    return options


def _convert(
    module: torch.nn.Module,
    sample: Sample,
    inputs: list[tuple[str, torch.Tensor]],
    extra: list[Sample],
    target: str,
    dynamic_shapes: Any,
    limits: tuple[float, float] | None,
    providers: Sequence[str] | None,
    options: dict[str, Any],
    budget: float | None = None,
) -> ConvertedModule:
    with torch.no_grad():
        eager_out = module(*sample[0], **sample[1])
    _, tree = flatten_outputs(eager_out)
    registered = register_dataclasses(eager_out)
    start = time.perf_counter()
    exported = export_module(module, sample[0], sample[1], inputs, dynamic_shapes)
    export_s = time.perf_counter() - start
    options = _with_module_exclusions(exported.model, options)
    graph_inputs = {v.name or "" for v in exported.model.graph.inputs}
    samples = [sample, *extra]
    feeds = [_feeds(module, s, graph_inputs) for s in samples]
    if target == "int8":
        if not extra:
            warnings.warn(
                "int8 without calibration_data: scales come from the example input and a "
                "perturbed copy of it; give real inputs as calibration_data",
                UserWarning,
                stacklevel=3,
            )
            feeds += [_feeds(module, s, graph_inputs) for s in perturbed(samples)]
        result = quantize(exported.model, feeds, **options)
    else:
        result = convert(exported.model, target, calibration_data=feeds, **options)
    report = result.report
    report.notes[:0] = [f"exported by {exported.exporter}", *exported.notes]
    if registered:
        report.notes.append(f"registered output dataclass(es) with torch's pytree: {registered}")
    report.timings = {"export": export_s, **report.timings}
    spec = ModuleSpec(
        dtype=target,
        exporter=exported.exporter,
        input_names=tuple(exported.input_names),
        positional=len(sample[0]),
        output_tree=tree,
    )
    converted = ConvertedModule(result.model, report, spec, providers=providers)
    if converted.runtime == "emulated":
        report.notes.append(converted.fallback_reason)
    if limits is None:
        return converted
    threshold, atol = limits

    def checked_against_eager(candidate: ConvertedModule) -> Any:
        return check_module(
            lambda s: _eager(module, s),
            lambda s: candidate.run_flat(*s),
            samples,
            candidate.output_paths,
            dtype=target,
            threshold=threshold,
            atol=atol,
            runtime=candidate.runtime,
            kinds=list(classify_outputs(candidate.onnx_model).values()),
        )

    checked = checked_against_eager(converted)
    if not checked.passed and budget is not None:
        # A budget the plain conversion misses: tune moves the most sensitive nodes back
        # to float until the exported model meets it, then the check runs again.
        tuned = tune(exported.model, target, feeds, metric="rel-l2", budget=budget)
        if tuned.passed:
            report = tuned.report
            report.notes[:0] = [
                f"exported by {exported.exporter}",
                *exported.notes,
                f"tuned to the budget: {tuned.message}",
            ]
            converted = ConvertedModule(tuned.model, report, spec, providers=providers)
            checked = checked_against_eager(converted)
    converted.check = checked
    report.validation = checked.to_dict()
    if not checked.passed:
        raise TorchCheckError(
            f"the {target} module is further from eager PyTorch than rel L2 "
            f"{threshold:.3g} allows:\n{checked.format_table()}",
            check=checked,
            report=report,
        )
    return converted
