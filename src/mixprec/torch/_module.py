"""The converted module: an ``nn.Module`` running the converted ONNX model on ONNX Runtime."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx_ir as ir
import torch

from mixprec.core.errors import MixprecError
from mixprec.pipeline.report import Report
from mixprec.torch._check import CheckReport
from mixprec.torch._io import read_saved, save_converted
from mixprec.torch._runtime import OrtRunner
from mixprec.torch._tree import Tree, leaf_paths, unflatten_outputs

__all__ = ["ConvertedModule", "ModuleSpec", "load"]

SPEC_VERSION = 1


@dataclass(frozen=True)
class ModuleSpec:
    """What the converted module needs besides the ONNX model (stored as JSON by ``save``).

    Attributes:
        dtype: "float16", "bfloat16" or "int8".
        exporter: the exporter that produced the FP32 ONNX model.
        input_names: the module's inputs in call order: positional, then keyword.
        positional: how many of them the example passed positionally.
        output_tree: the nesting of the outputs (see :mod:`mixprec.torch._tree`).
    """

    dtype: str
    exporter: str
    input_names: tuple[str, ...]
    positional: int
    output_tree: Tree

    def to_dict(self) -> dict[str, object]:
        return {"version": SPEC_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModuleSpec:
        if data.get("version") != SPEC_VERSION:
            raise MixprecError(f"unsupported mixprec.torch file version {data.get('version')!r}")
        try:
            return cls(
                dtype=str(data["dtype"]),
                exporter=str(data["exporter"]),
                input_names=tuple(data["input_names"]),
                positional=int(data["positional"]),
                output_tree=dict(data["output_tree"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise MixprecError(f"malformed mixprec.torch spec: {exc!r}") from None


class ConvertedModule(torch.nn.Module):
    """A converted module: called like the original, it runs the ONNX model on ORT.

    Takes torch tensors (positionally and by name, as the original's ``forward``) and
    returns torch tensors in the original's output structure, on the first input's
    device. It holds no parameters: ``state_dict()`` is empty.

    Attributes:
        onnx_model: the converted ``onnx_ir.Model``.
        report: the conversion's :class:`mixprec.Report`; ``report.validation`` holds
            the check against eager PyTorch.
        spec: the :class:`ModuleSpec`.
        check: the :class:`~mixprec.torch.CheckReport`, or None (``check=False``, or a
            module loaded from disk).
        runtime: "onnxruntime" or "emulated" (bfloat16 on a provider without bf16
            kernels: the FP32 emulation runs).
    """

    def __init__(
        self,
        onnx_model: ir.Model,
        report: Report,
        spec: ModuleSpec,
        *,
        providers: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self.onnx_model = onnx_model
        self.report = report
        self.spec = spec
        self.check: CheckReport | None = None
        self._runner = OrtRunner(onnx_model, providers)
        self.parameter_bytes = sum(
            v.const_value.nbytes
            for v in onnx_model.graph.initializers.values()
            if v.const_value is not None
        )
        self.output_paths = leaf_paths(spec.output_tree)
        if len(self.output_paths) != len(self._runner.output_names):
            raise MixprecError(
                f"the exported model has {len(self._runner.output_names)} output(s), the "
                f"module's output structure {len(self.output_paths)} tensor(s); return each "
                "tensor once",
                stage="export",
            )

    @property
    def runtime(self) -> str:
        return self._runner.kind

    def new_session(
        self, *, providers: Sequence[str] | None = None, threads: int = 0
    ) -> ConvertedModule:
        """Recreate the ONNX Runtime session, e.g. with ``threads`` intra-op threads.

        Args:
            providers: execution providers (default: CUDA when available, CPU).
            threads: ORT's intra-op thread count; 0 lets ORT choose (one per core).

        Returns:
            ``self``.
        """
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise MixprecError(f"threads must be an int >= 0, not {threads!r}")
        self._runner = OrtRunner(self.onnx_model, providers, threads)
        return self

    @property
    def fallback_reason(self) -> str:
        """Why the model runs emulated, or empty."""
        return self._runner.fallback_reason

    @property
    def providers(self) -> list[str]:
        return list(self._runner.providers)

    def feeds(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors by input name for a call with ``args`` and ``kwargs``.

        Raises:
            MixprecError: too many positional inputs, an unknown or missing name, or a
                value that is not a tensor.
        """
        names = self.spec.input_names
        if len(args) > self.spec.positional:
            raise MixprecError(
                f"the converted module takes at most {self.spec.positional} positional "
                f"input(s) ({', '.join(names[: self.spec.positional])}), got {len(args)}; "
                "pass the others by name"
            )
        feeds = dict(zip(names, args, strict=False))
        for name, value in kwargs.items():
            if name not in names:
                raise MixprecError(f"unknown input {name!r}; the inputs are {list(names)}")
            if name in feeds:
                raise MixprecError(f"input {name!r} given both by position and by name")
            feeds[name] = value
        needed = [n for n in names if n in self._runner.input_types]
        missing = [n for n in needed if n not in feeds]
        if missing:
            raise MixprecError(f"missing input(s) {missing}; the inputs are {list(names)}")
        for name, value in feeds.items():
            if not isinstance(value, torch.Tensor):
                raise MixprecError(
                    f"input {name!r} is a {type(value).__name__}, not a torch.Tensor"
                )
        return feeds

    def run_flat(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
        """The output tensors in flattening order (no structure)."""
        return self._runner.run(self.feeds(args, kwargs))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return unflatten_outputs(self.spec.output_tree, self.run_flat(args, kwargs))

    def save(self, path: str) -> None:
        """Write a folder: ``model.onnx``, ``mixprec_torch.json`` and ``report.json``.

        :func:`mixprec.torch.load` reads it back without the original module's class.
        """
        save_converted(path, self.onnx_model, self.spec.to_dict(), self.report)

    def extra_repr(self) -> str:
        r = self.report
        return (
            f"dtype={self.spec.dtype}, low-precision nodes {r.low_node_share:.1%} "
            f"({r.low_nodes}/{len(r.nodes)}), weights {self.parameter_bytes / 1e6:.2f} MB, "
            f"runtime={self.runtime} on {self.providers[0]}"
        )


def load(
    path: str | os.PathLike[str], *, providers: Sequence[str] | None = None
) -> ConvertedModule:
    """Load a module saved by :meth:`ConvertedModule.save`.

    Args:
        path: the folder.
        providers: ONNX Runtime execution providers (default: CUDA when available, CPU).

    Raises:
        MixprecError: the folder or one of its files is missing or malformed.

    Example:
        >>> module = mixprec.torch.load("resnet_fp16")               # doctest: +SKIP
        >>> logits = module(images)                                 # doctest: +SKIP
    """
    model, report, spec_data = read_saved(path)
    return ConvertedModule(model, report, ModuleSpec.from_dict(spec_data), providers=providers)
