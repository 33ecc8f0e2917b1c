"""Running a converted model on ONNX Runtime with torch tensors in and out, through the
runtime door (:func:`~mixprec.runtime.engines.engine_for`).

Inputs are bound in place (:class:`~mixprec.runtime.engine.DeviceBuffer`: no copy for
contiguous tensors of the graph's dtype, on CPU or, with the CUDA execution provider, on
the GPU); outputs are allocated by ONNX Runtime on the device of the first input and
handed to torch.

ONNX Runtime's CPU provider has almost no bfloat16 kernels: a bfloat16 model that it
cannot load is run as its FP32 emulation (:class:`mixprec.EmulateLowPrecisionPass`:
every bfloat16 tensor rounded through bfloat16, arithmetic in FP32), and
:attr:`OrtRunner.kind` says so.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from mixprec.core.errors import MixprecError
from mixprec.passes.emulate import emulate_low_precision
from mixprec.runtime.engine import (
    ORT_PROVIDERS,
    DeviceBuffer,
    RuntimeOptions,
    Session,
    provider_named,
)
from mixprec.runtime.engines import engine_for

__all__ = ["OrtRunner", "default_providers"]

logger = logging.getLogger(__name__)

_NUMPY_TYPES: dict[ir.DataType, type[np.generic]] = {
    ir.DataType.FLOAT: np.float32,
    ir.DataType.FLOAT16: np.float16,
    ir.DataType.DOUBLE: np.float64,
    ir.DataType.INT64: np.int64,
    ir.DataType.INT32: np.int32,
    ir.DataType.INT16: np.int16,
    ir.DataType.INT8: np.int8,
    ir.DataType.UINT8: np.uint8,
    ir.DataType.BOOL: np.bool_,
}
_TORCH_TYPES: dict[ir.DataType, torch.dtype] = {
    ir.DataType.FLOAT: torch.float32,
    ir.DataType.FLOAT16: torch.float16,
    ir.DataType.BFLOAT16: torch.bfloat16,
    ir.DataType.DOUBLE: torch.float64,
    ir.DataType.INT64: torch.int64,
    ir.DataType.INT32: torch.int32,
    ir.DataType.INT16: torch.int16,
    ir.DataType.INT8: torch.int8,
    ir.DataType.UINT8: torch.uint8,
    ir.DataType.BOOL: torch.bool,
}


def default_providers() -> list[str]:
    """CUDA then CPU when this onnxruntime build has the CUDA provider, else CPU."""
    cuda = RuntimeOptions(provider="cuda")
    return list(ORT_PROVIDERS["cuda" if engine_for("ort").missing(cuda) is None else "cpu"])


def _provider(providers: Sequence[str]) -> str:
    """The ``RuntimeOptions.provider`` of an ONNX Runtime provider list (its first)."""
    first = providers[0] if providers else ORT_PROVIDERS["cpu"][0]
    found = provider_named(first)
    if found is None:
        known = ", ".join(names[0] for names in ORT_PROVIDERS.values())
        raise MixprecError(f"unknown execution provider {first!r}: use one of {known}")
    return found


def torch_dtype_of(dtype: ir.DataType | None) -> torch.dtype | None:
    """The torch dtype of an ONNX element type, None when torch has none."""
    return _TORCH_TYPES.get(dtype) if dtype is not None else None


def _has_bfloat16(model: ir.Model) -> bool:
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for value in node.outputs:
            if value.dtype == ir.DataType.BFLOAT16:
                return True
    return any(
        v.const_value is not None and v.const_value.dtype == ir.DataType.BFLOAT16
        for v in model.graph.initializers.values()
    )


def _to_torch(value: Any) -> torch.Tensor:
    """An output (an OrtValue or an array) as a tensor: shared through DLPack, copied
    where that fails."""
    try:
        return torch.from_dlpack(value)
    except (RuntimeError, TypeError, BufferError):
        return torch.from_numpy(value.numpy())


class OrtRunner:
    """An ONNX Runtime session over a converted model, fed with torch tensors.

    Attributes:
        providers: the execution providers the session uses.
        kind: "onnxruntime" (the model as converted) or "emulated" (its FP32 emulation).
        fallback_reason: why the model runs emulated, or empty.
    """

    def __init__(
        self, model: ir.Model, providers: Sequence[str] | None = None, threads: int = 0
    ) -> None:
        self.providers = list(providers) if providers else default_providers()
        self.input_types = {v.name or "": v.dtype for v in model.graph.inputs}
        self.input_shapes = {
            v.name or "": [d if isinstance(d, int) else str(d) for d in v.shape]
            if v.shape is not None
            else None
            for v in model.graph.inputs
        }
        self.output_names = [v.name or "" for v in model.graph.outputs]
        self.kind = "onnxruntime"
        self.fallback_reason = ""
        self._threads = threads
        self._chosen = providers is not None
        try:
            self.session = self._session(model)
        except MixprecError as exc:
            if not _has_bfloat16(model):
                raise MixprecError(f"cannot load the converted model: {exc}") from exc
            self.fallback_reason = (
                f"onnxruntime ({', '.join(self.providers)}) cannot run this bfloat16 model "
                f"({exc}); running its FP32 emulation"
            )
            logger.info("%s", self.fallback_reason)
            self.kind = "emulated"
            self.session = self._session(emulate_low_precision(model), optimize=False)

    def _session(self, model: ir.Model, optimize: bool = True) -> Session:
        # unoptimized beyond the basics: ORT's fusions would swallow an emulation's Casts
        options = RuntimeOptions(
            threads=self._threads,
            provider=_provider(self.providers),
            optimization="all" if optimize else "basic",
        )
        proto = ir.to_proto(model)
        try:
            return engine_for(options).session(proto, options)
        except MixprecError:
            if self._chosen or options.provider == "cpu":
                raise
        # the default CUDA provider did not start (no device): the CPU, as ORT would
        self.providers = list(ORT_PROVIDERS["cpu"])
        options = dataclasses.replace(options, provider="cpu")
        return engine_for(options).session(proto, options)

    @property
    def device(self) -> str:
        """``"cuda"`` when the session runs on a GPU provider, else ``"cpu"``."""
        return "cpu" if _provider(self.providers) == "cpu" else "cuda"

    def _buffer(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(the tensor to keep alive, what to bind): a :class:`DeviceBuffer` over its
        storage, or a numpy array where the dtype has no numpy twin."""
        expected = self.input_types.get(name)
        want = torch_dtype_of(expected)
        if want is not None and tensor.dtype != want:
            raise MixprecError(
                f"input {name!r} is {tensor.dtype}, but the converted model takes {want}"
            )
        on_gpu = tensor.is_cuda and self.device == "cuda"
        tensor = tensor.contiguous() if on_gpu else tensor.detach().cpu().contiguous()
        if expected is None or expected not in _NUMPY_TYPES:
            return tensor, tensor.numpy()
        buffer = DeviceBuffer(
            "cuda" if on_gpu else "cpu",
            tensor.device.index or 0 if on_gpu else 0,
            np.dtype(_NUMPY_TYPES[expected]),
            tuple(tensor.shape),
            tensor.data_ptr(),
        )
        return tensor, buffer

    def run(self, feeds: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Run on named tensors; the outputs in graph order, on the first input's device.

        Raises:
            MixprecError: a dtype does not match, or onnxruntime fails (e.g. a shape
                that the export made static); the message shows the expected shapes.
        """
        kept = []  # the bound tensors must outlive the run
        inputs: dict[str, Any] = {}
        device = "cpu"
        for name, tensor in feeds.items():
            if name not in self.input_types:
                continue
            device = "cuda" if tensor.is_cuda and self.device == "cuda" else device
            held, inputs[name] = self._buffer(name, tensor)
            kept.append(held)
        try:
            values = self._run(inputs)
        except MixprecError as exc:
            got = {n: list(t.shape) for n, t in feeds.items()}
            raise MixprecError(
                f"{exc} (inputs {got}; the exported model takes {self.input_shapes})"
            ) from exc
        del kept
        outputs = [_to_torch(value) for value in values]
        target = torch.device(device)
        return [out.to(target) if out.device != target else out for out in outputs]

    def _run(self, inputs: Mapping[str, Any]) -> list[Any]:
        """The outputs in graph order: in place where the session binds buffers, else
        through host arrays."""
        run_buffers = getattr(self.session, "run_buffers", None)
        if run_buffers is not None:
            return list(run_buffers(inputs, self.device))
        arrays = {n: _host_array(x) for n, x in inputs.items()}
        out = self.session.run(arrays)
        return [np.ascontiguousarray(out[name]) for name in self.output_names]


def _host_array(x: Any) -> np.ndarray:
    """A bound input as a host array (a CPU :class:`DeviceBuffer` viewed, not copied)."""
    if not isinstance(x, DeviceBuffer):
        return np.asarray(x)
    if x.device != "cpu":
        raise MixprecError("this runtime's sessions take host arrays: move the inputs to the CPU")
    count = int(np.prod(x.shape)) if x.shape else 1
    raw = (ctypes.c_byte * (count * x.dtype.itemsize)).from_address(x.pointer)
    return np.frombuffer(memoryview(raw).cast("B"), dtype=x.dtype).reshape(x.shape)
